"""The ``lorafleet keys`` / ``lorafleet adapter`` commands against a running registry."""

import argparse
import asyncio
import json
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from lorafleet.cli import adapter_cmd, keys_cmd


async def lorafleet(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="lorafleet")
    sub = parser.add_subparsers(dest="command", required=True)
    adapter_cmd.register(sub)
    keys_cmd.register(sub)
    args = parser.parse_args(argv)
    code = await asyncio.to_thread(args.func, args)  # the commands run their own event loop
    return code, capsys.readouterr().out


async def test_keys_then_signed_push_promote_and_show(
    registry: NATS, nats_url: str, peft_adapter_dir: Path, base_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    url = ["--nats-url", nats_url]
    code, out = await lorafleet(["keys", "gen", "cli-release", "--out", str(tmp_path)], capsys)
    assert code == 0 and (tmp_path / "cli-release.key").stat().st_mode & 0o777 == 0o600
    code, out = await lorafleet(["keys", "trust", "cli-release", str(tmp_path / "cli-release.pub"), *url], capsys)
    assert code == 0 and "cli-release" in out
    push = ["adapter", "push", str(peft_adapter_dir), "--id", "cli-sum", "--tenant", "acme", "--task", "summarization",
            "--sign-key", str(tmp_path / "cli-release.key"), "--base-model-dir", str(base_dir),
            "--alias", "clisum", *url]  # fmt: skip
    code, out = await lorafleet(push, capsys)
    assert code == 0 and "staging" in out
    code, out = await lorafleet(["adapter", "promote", "cli-sum", "1", "--percent", "100", *url], capsys)
    assert code == 0 and "production" in out
    code, out = await lorafleet(["adapter", "show", "cli-sum", "--json", *url], capsys)
    shown = json.loads(out)
    summary = [(r["version"], r["status"], r["signer"], r["aliases"]) for r in shown]
    assert summary == [(1, "production", "cli-release", ["clisum"])]
    code, out = await lorafleet(["adapter", "rollout", "cli-sum", "--percent", "50", *url], capsys)
    assert code == 1 and "error (conflict): cli-sum has no canary version to roll out" in out
