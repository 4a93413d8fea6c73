"""The ``lorafleet keys`` / ``lorafleet adapter`` commands against a running registry."""

import argparse
import asyncio
import hashlib
import json
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from lorafleet.cli import adapter_cmd, keys_cmd, release_cmd


async def lorafleet(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="lorafleet")
    sub = parser.add_subparsers(dest="command", required=True)
    adapter_cmd.register(sub)
    keys_cmd.register(sub)
    release_cmd.register(sub)
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
    trust = ["keys", "trust", "cli-release", str(tmp_path / "cli-release.pub"), "--tenant", "acme", *url]
    code, out = await lorafleet(trust, capsys)
    assert code == 0 and "cli-release" in out and "tenants=acme" in out
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


async def test_an_eval_set_is_pushed_signed_with_its_version_or_attached_later(
    registry: NATS, nats_url: str, peft_adapter_dir: Path, base_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    url = ["--nats-url", nats_url]
    await lorafleet(["keys", "gen", "cli-evals", "--out", str(tmp_path)], capsys)
    trust = ["keys", "trust", "cli-evals", str(tmp_path / "cli-evals.pub"), "--tenant", "acme", *url]
    assert (await lorafleet(trust, capsys))[0] == 0
    pushed, attached, broken = tmp_path / "pushed.jsonl", tmp_path / "attached.jsonl", tmp_path / "broken.jsonl"
    pushed.write_text('{"meta": {"threshold": 0.5}}\n{"prompt": "2+2=", "expected": "4", "scorer": "exact"}\n')
    attached.write_text('{"prompt": "3+3=", "expected": "6"}\n')
    broken.write_text('{"prompt": "3+3=", "expected": "6", "scorer": "vibes"}\n')
    push = ["adapter", "push", str(peft_adapter_dir), "--id", "cli-evals", "--tenant", "acme", "--task", "summarization",
            "--sign-key", str(tmp_path / "cli-evals.key"), "--base-model-dir", str(base_dir), *url]  # fmt: skip
    code, out = await lorafleet([*push, "--eval-set", str(broken)], capsys)
    assert (
        code == 1 and "error (invalid_request): eval.jsonl:1: unknown scorer 'vibes'" in out
    )  # refused before any upload
    assert (await lorafleet([*push, "--eval-set", str(pushed)], capsys))[0] == 0
    code, out = await lorafleet(["adapter", "show", "cli-evals", "--json", *url], capsys)
    [record] = json.loads(out)
    digest = hashlib.sha256(pushed.read_bytes()).hexdigest()
    # the signed manifest covers it (the registry verified the signature over every file's digest)
    assert record["files"]["eval.jsonl"] == digest and record["eval_set_digest"] == digest
    assert record["platform_eval"] is None
    code, out = await lorafleet(["adapter", "attach-eval", "cli-evals", "1", str(broken), *url], capsys)
    assert code == 1 and "error (invalid_request)" in out
    assert (await lorafleet(["adapter", "attach-eval", "cli-evals", "1", str(attached), *url], capsys))[0] == 0
    code, out = await lorafleet(["adapter", "show", "cli-evals", "--json", *url], capsys)
    [record] = json.loads(out)
    assert record["eval_set_digest"] == hashlib.sha256(attached.read_bytes()).hexdigest()
    assert record["files"]["eval.jsonl"] == digest  # what was signed stays as signed
    code, out = await lorafleet(["adapter", "promote", "cli-evals", "1", "--skip-eval", *url], capsys)
    assert code == 1 and "--skip-eval needs --reason" in out


async def test_a_signer_is_rotated_explicitly_and_untrusted_from_the_cli(
    registry: NATS, nats_url: str, peft_adapter_dir: Path, base_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    url = ["--nats-url", nats_url]
    for generation in ("old", "new"):  # the signer's name is its key file's
        await lorafleet(["keys", "gen", "cli-rotor", "--out", str(tmp_path / generation)], capsys)
    trust = ["keys", "trust", "cli-rotor", "--tenant", "acme", *url]
    assert (await lorafleet([*trust, str(tmp_path / "old" / "cli-rotor.pub")], capsys))[0] == 0
    code, out = await lorafleet([*trust, str(tmp_path / "new" / "cli-rotor.pub")], capsys)  # no silent overwrite
    assert code == 1 and "error (conflict): signer 'cli-rotor' is already known" in out
    code, out = await lorafleet([*trust, str(tmp_path / "new" / "cli-rotor.pub"), "--rotate"], capsys)
    assert code == 0 and (tmp_path / "new" / "cli-rotor.pub").read_text().strip() in out

    def push(adapter_id: str, key: str) -> list[str]:
        return ["adapter", "push", str(peft_adapter_dir), "--id", adapter_id, "--tenant", "acme", "--task", "t",
                "--sign-key", str(tmp_path / key / "cli-rotor.key"), "--base-model-dir", str(base_dir), *url]  # fmt: skip

    code, out = await lorafleet(push("cli-rot-a", "old"), capsys)
    assert code == 1 and "signature does not match" in out  # the rotated-out key signs nothing new
    assert (await lorafleet(push("cli-rot-a", "new"), capsys))[0] == 0
    code, out = await lorafleet(["keys", "untrust", "cli-rotor", *url], capsys)
    assert code == 0 and "untrusted" in out
    code, out = await lorafleet(push("cli-rot-b", "new"), capsys)
    assert code == 1 and "error (integrity_error): signer 'cli-rotor' is not a trusted signer" in out
    code, out = await lorafleet(["adapter", "show", "cli-rot-a", "--json", *url], capsys)
    assert code == 0 and json.loads(out)[0]["signer"] == "cli-rotor"  # its version stays


async def test_release_starts_a_controlled_rollout_and_returns_and_status_shows_it(
    registry: NATS, nats_url: str, peft_adapter_dir: Path, base_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    url = ["--nats-url", nats_url]
    await lorafleet(["keys", "gen", "cli-canary", "--out", str(tmp_path)], capsys)
    trust = ["keys", "trust", "cli-canary", str(tmp_path / "cli-canary.pub"), "--tenant", "acme", *url]
    assert (await lorafleet(trust, capsys))[0] == 0
    push = ["adapter", "push", str(peft_adapter_dir), "--id", "cli-rel", "--tenant", "acme", "--task", "summarization",
            "--sign-key", str(tmp_path / "cli-canary.key"), "--base-model-dir", str(base_dir), *url]  # fmt: skip
    for _ in range(2):
        assert (await lorafleet(push, capsys))[0] == 0
    assert (await lorafleet(["adapter", "promote", "cli-rel", "1", "--percent", "100", *url], capsys))[0] == 0
    code, out = await lorafleet(["release", "cli-rel", "2", *url], capsys)  # the eval gate is on by default
    assert code == 1 and "error (release_gate_failed): cli-rel v2 has no eval set" in out
    code, out = await lorafleet(["release", "status", "cli-rel", *url], capsys)
    assert code == 0 and "cli-rel v2 (gate_failed)" in out and "gate_failed at 0%: cli-rel v2 has no eval set" in out
    code, out = await lorafleet(["release", "cli-rel", "2", "--skip-eval", "--reason", "hotfix", *url], capsys)
    assert code == 0 and out.splitlines()[-1] == "cli-rel v2: rollout started at 1% (`lorafleet release status`)"
    code, out = await lorafleet(["release", "status", "cli-rel", *url], capsys)
    lines = [line for line in out.splitlines() if "[info" not in line]  # the in-process registry logs here too
    assert code == 0 and lines[0].startswith("cli-rel v2 (running) vs production v1: [1%] -> 10% -> 50% -> 100%")
    assert "started at 1%: eval gate skipped by platform admin" in lines[-1] and lines[-1].endswith(": hotfix")
    code, out = await lorafleet(["release", "cli-rel", "two", *url], capsys)
    assert code == 1 and "error (invalid_request): version 'two'" in out


async def test_adapter_pin_unpin_and_pins_from_the_cli(
    registry: NATS, nats_url: str, peft_adapter_dir: Path, base_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    url = ["--nats-url", nats_url]
    await lorafleet(["keys", "gen", "cli-pinner", "--out", str(tmp_path)], capsys)
    await lorafleet(["keys", "trust", "cli-pinner", str(tmp_path / "cli-pinner.pub"), "--tenant", "acme", *url], capsys)
    push = ["adapter", "push", str(peft_adapter_dir), "--id", "cli-pin", "--tenant", "acme", "--task", "t",
            "--sign-key", str(tmp_path / "cli-pinner.key"), "--base-model-dir", str(base_dir), *url]  # fmt: skip
    assert (await lorafleet(push, capsys))[0] == 0
    code, out = await lorafleet(["adapter", "pin", "cli-pin", *url], capsys)
    assert code == 0 and out.splitlines()[1].split()[:4] == ["cli-pin", "served", "every", "acme"]
    code, out = await lorafleet(["adapter", "pin", "cli-pin", "--worker", "w1", "--version", "1", *url], capsys)
    assert code == 0 and len(out.splitlines()) == 3
    code, out = await lorafleet(["adapter", "pins", "cli-pin", "--json", *url], capsys)
    assert [(p["version"], p["worker_id"]) for p in json.loads(out)] == [(None, None), (1, "w1")]
    code, out = await lorafleet(["adapter", "pin", "cli-pin", "--version", "2", *url], capsys)
    assert code == 1 and "error (not_found): adapter 'cli-pin' has no version 2" in out
    code, out = await lorafleet(["adapter", "unpin", "cli-pin", *url], capsys)
    assert code == 0 and out.splitlines()[1].split()[:3] == ["cli-pin", "1", "w1"]
    code, out = await lorafleet(["adapter", "unpin", "cli-pin", *url], capsys)
    assert code == 1 and "error (not_found): adapter 'cli-pin' has no such pin" in out
    code, out = await lorafleet(["adapter", "pin", "nothing", *url], capsys)
    assert code == 1 and "error (not_found)" in out
