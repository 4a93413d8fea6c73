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


def serve_metrics(port: int, host: str = "127.0.0.1", token: str | None = None) -> int | None:
    """Expose /metrics on ``port`` (0 = any free port, -1 = off), requiring ``token`` as a bearer token
    when given; the port actually used."""
    if port < 0:
        return None
    server_class = _Server6 if ":" in host else _Server
    server = make_server(host.strip("[]"), port, guarded(make_wsgi_app(), token), server_class, _QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    actual = server.server_address[1]
    log.info("metrics_listening", port=actual, authenticated=token is not None)
    return actual
