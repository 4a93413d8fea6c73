"""/metrics over HTTP behind a bearer token: every service's own listener, and the check the gateway's route shares."""

import hmac
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import make_wsgi_app

log = structlog.get_logger()

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
CHALLENGE = ("WWW-Authenticate", 'Bearer realm="metrics"')
POLL_S = 0.1  # how often the serving thread looks for a close: the longest a close blocks


def bearer_matches(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``token`` (None = no token required), in constant time."""
    if token is None:
        return True
    return hmac.compare_digest((header or "").encode(), f"Bearer {token}".encode())


def guarded(app: WsgiApp, token: str | None) -> WsgiApp:
    """``app`` answering 401 to any request without ``Authorization: Bearer <token>``."""

    def guarded_app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if bearer_matches(environ.get("HTTP_AUTHORIZATION"), token):
            return app(environ, start_response)
        start_response("401 Unauthorized", [CHALLENGE, ("Content-Type", "text/plain; charset=utf-8")])
        return [b"metrics_token_required: send 'Authorization: Bearer <LF_METRICS_TOKEN_FILE>'\n"]

    return guarded_app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # the base class's signature
        """Scrapes are not worth a log line each."""


class MetricsServer:
    """A running /metrics listener: its ``port`` (None when off) and ``close`` (also on leaving a ``with``),
    which stops it and frees the port, so that a stopped service's port can be bound again."""

    def __init__(self, server: WSGIServer | None = None) -> None:
        self._server = server
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        if server is not None:
            self.port = server.server_address[1]
            self._thread = threading.Thread(
                target=server.serve_forever, args=(POLL_S,), name="metrics-http", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Stop serving (within ``POLL_S``) and close the listening socket; again is a no-op."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(port: int, host: str = "127.0.0.1", token: str | None = None) -> MetricsServer:
    """Expose /metrics on ``port`` (0 = any free port, -1 = off), requiring ``token`` as a bearer token
    when given; the listener (its ``port`` the one actually used), for the caller to close."""
    if port < 0:
        return MetricsServer()
    server_class = _Server6 if ":" in host else _Server
    server = make_server(host.strip("[]"), port, guarded(make_wsgi_app(), token), server_class, _QuietHandler)
    listener = MetricsServer(server)
    log.info("metrics_listening", port=listener.port, authenticated=token is not None)
    return listener
