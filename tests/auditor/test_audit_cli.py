"""``lorafleet audit query|verify`` ask the running auditor over its subject, not its SQLite file."""

import asyncio
import json
import sqlite3

import pytest

from lorafleet.cli.main import main
from lorafleet.cli.stack import Stack
from tests.auditor.test_auditor_restart import publish, wait_count


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    return int(exit_.value.code or 0), capsys.readouterr().out


def test_query_and_verify_go_through_the_auditor(own_nats, tmp_path, capsys) -> None:
    db = tmp_path / "audit.sqlite3"
    stack = Stack({"LF_NATS_URL": own_nats.url, "LF_DB_PATH": str(db), "LF_METRICS_PORT": "-1"}, tmp_path / "logs")
    try:
        stack.start("auditor")
        asyncio.run(publish(own_nats.url, 0, 12))
        wait_count(db, 12)
        code, out = cli(capsys, "audit", "query", "--tenant", "acme", "--limit", "5", "--nats-url", own_nats.url)
        rows = [json.loads(line) for line in out.splitlines()]
        assert code == 0 and len(rows) == 5 and {r["tenant_id"] for r in rows} == {"acme"}
        code, out = cli(capsys, "audit", "query", "--tenant", "nobody", "--nats-url", own_nats.url)
        assert code == 0 and out == ""
        code, out = cli(capsys, "audit", "verify", "--nats-url", own_nats.url)
        assert code == 0 and out.strip() == "audit chain intact: 12 records"

        with sqlite3.connect(db) as conn:  # an operator with file access rewrites one record
            conn.execute("UPDATE audit SET body = replace(body, 'req-4', 'req-x') WHERE pos = 5")
        code, out = cli(capsys, "audit", "verify", "--nats-url", own_nats.url)
        assert code == 2 and "BROKEN at record 5" in out
    finally:
        stack.stop_all()


def test_an_unreachable_bus_is_a_clear_error(capsys) -> None:
    code, out = cli(capsys, "audit", "verify", "--nats-url", "nats://127.0.0.1:1")
    assert code == 1 and out.startswith("error (service_unavailable)")
