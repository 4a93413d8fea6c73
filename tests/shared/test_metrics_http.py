"""/metrics behind a bearer token: a running service's own listener and the gateway's route refuse a scrape
without the deployment's token (401) and serve one with it; a service refuses to expose /metrics beyond
loopback without a token; a closed listener frees its port."""

import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from lorafleet.cli.infra import free_port, wait_port
from lorafleet.cli.stack import Stack
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from shared.metrics_http import serve_metrics

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "metrics-token"
    path.write_text(secrets.token_urlsafe(24) + "\n")
    return path


@pytest.fixture
def auditor_metrics(nats_url: str, token_file: Path, tmp_path: Path) -> Iterator[str]:
    """A running auditor whose /metrics listens on every interface, as in compose and k8s; its URL."""
    port = free_port()
    stack = Stack({"LF_NATS_URL": nats_url, "LF_DB_PATH": str(tmp_path / "audit.sqlite3")}, tmp_path / "logs")
    env = {"LF_METRICS_HOST": "0.0.0.0", "LF_METRICS_PORT": str(port), "LF_METRICS_TOKEN_FILE": str(token_file)}
    proc = stack.start("auditor", env)
    try:
        wait_port(port, 60, proc)
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        stack.stop_all()


def test_a_running_service_refuses_a_scrape_without_its_token(auditor_metrics: str, token_file: Path) -> None:
    token = token_file.read_text().strip()
    bare = httpx.get(auditor_metrics, timeout=10)
    assert bare.status_code == 401 and bare.headers["www-authenticate"].startswith("Bearer")
    assert "tenant_isolation" not in bare.text
    wrong = httpx.get(auditor_metrics, headers={"Authorization": f"Bearer {token}x"}, timeout=10)
    assert wrong.status_code == 401
    assert httpx.get(auditor_metrics, headers={"Authorization": token}, timeout=10).status_code == 401
    scraped = httpx.get(auditor_metrics, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert scraped.status_code == 200 and "tenant_isolation_errors_total" in scraped.text


def test_a_service_without_a_token_keeps_metrics_on_loopback(nats_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LF_")}
    env.update(LF_NATS_URL=nats_url, LF_METRICS_HOST="0.0.0.0", LF_DB_PATH=str(tmp_path / "audit.sqlite3"))
    done = subprocess.run(
        [sys.executable, "-m", "services.auditor"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert "invalid configuration" in done.stderr and "LF_METRICS_TOKEN_FILE" in done.stderr


def test_the_gateway_refuses_a_scrape_without_its_token(token_file: Path) -> None:
    settings = GatewaySettings(host="0.0.0.0", metrics_token_file=token_file)
    app = create_app(SimpleNamespace(settings=settings))  # type: ignore[arg-type]  # /metrics reads settings only
    with TestClient(app) as client:
        bare = client.get("/metrics")
        assert bare.status_code == 401 and bare.json()["error"]["code"] == "metrics_token_required"
        headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        scraped = client.get("/metrics", headers=headers)
    assert scraped.status_code == 200 and "admission_rejections_total" in scraped.text


def test_the_gateway_serves_beyond_loopback_only_with_a_metrics_token(token_file: Path) -> None:
    with pytest.raises(ValueError, match="LF_METRICS_TOKEN_FILE"):
        GatewaySettings(host="0.0.0.0")
    assert GatewaySettings(host="127.0.0.1").metrics_bearer() is None
    assert GatewaySettings(host="0.0.0.0", metrics_token_file=token_file).metrics_bearer()


def _bind(port: int) -> None:
    """Listen on ``port`` as a server would (SO_REUSEADDR, as the metrics listener sets), then let it go."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_a_closed_listener_frees_its_port() -> None:
    listener = serve_metrics(0)
    port = listener.port
    assert port
    assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
    with pytest.raises(OSError):  # still listening: the port is taken
        _bind(port)
    listener.close()
    listener.close()  # again: nothing left to close
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    _bind(port)
    with serve_metrics(port) as again:  # a restarted service takes the same port back
        assert again.port == port
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
    _bind(port)


def test_metrics_off_has_no_port_and_nothing_to_close() -> None:
    with serve_metrics(-1) as off:
        assert off.port is None
