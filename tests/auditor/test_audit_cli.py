"""``lorafleet audit query|verify`` ask the running auditor over its subject, not its SQLite file."""

import asyncio
import json
import time

import pytest

from lorafleet.cli.main import main
from lorafleet.cli.stack import Stack
from tests.auditor.test_auditor_restart import publish, wait_count
from tests.auditor.test_chain_heads import relink_from


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    return int(exit_.value.code or 0), capsys.readouterr().out


def test_query_and_verify_go_through_the_auditor(own_nats, tmp_path, capsys) -> None:
    db = tmp_path / "audit.sqlite3"
    env = {"LF_NATS_URL": own_nats.url, "LF_DB_PATH": str(db), "LF_METRICS_PORT": "-1", "LF_HEAD_INTERVAL_S": "0.2"}
    stack = Stack(env, tmp_path / "logs")
    try:
        stack.start("auditor")
        asyncio.run(publish(own_nats.url, 0, 12))
        wait_count(db, 12)
        code, out = cli(capsys, "audit", "query", "--tenant", "acme", "--limit", "5", "--nats-url", own_nats.url)
        rows = [json.loads(line) for line in out.splitlines()]
        assert code == 0 and [r["request_id"] for r in rows] == [f"req-{i}" for i in (11, 10, 9, 8, 7)]
        code, out = cli(
            capsys, "audit", "query", "--tenant", "acme", "--before", str(rows[-1]["pos"]), "--nats-url", own_nats.url
        )
        assert code == 0 and json.loads(out.splitlines()[0])["request_id"] == "req-6"
        code, out = cli(capsys, "audit", "query", "--tenant", "nobody", "--nats-url", own_nats.url)
        assert code == 0 and out == ""
        deadline = time.monotonic() + 30
        while not out.startswith("audit chain intact: 12 records, signed up to 12"):
            assert time.monotonic() < deadline, out
            code, out = cli(capsys, "audit", "verify", "--nats-url", own_nats.url)
        assert code == 0 and "head key: " in out
        key = (tmp_path / "auditor-head.key.pub").read_text().strip()
        assert out.strip().endswith(key)

        relink_from(db, 5, "req-4", "req-x")  # an operator with file access rewrites one record and re-links
        code, out = cli(capsys, "audit", "verify", "--nats-url", own_nats.url)
        assert code == 2 and "BROKEN at record 1: rewritten" in out
    finally:
        stack.stop_all()


def test_an_unreachable_bus_is_a_clear_error(capsys) -> None:
    code, out = cli(capsys, "audit", "verify", "--nats-url", "nats://127.0.0.1:1")
    assert code == 1 and out.startswith("error (service_unavailable)")
