"""``lorafleet keys ...``: make an Ed25519 signing key; trust, rotate and untrust a signer, bound
to the tenants it may sign for."""

import argparse
import asyncio
import os
from collections.abc import Iterable
from pathlib import Path

from nats.aio.client import Client as NATS

from lorafleet.cli.adapter_cmd import TIMEOUT_S, actor, cli_connect
from shared import signing, subjects
from shared.bus import request
from shared.errors import LorafleetError
from shared.schemas import ListKeysRequest, SignerRecord, TrustedKeysReply, TrustKeyRequest, UntrustKeyRequest


def generate(name: str, out_dir: Path) -> tuple[Path, str]:
    """Write ``NAME.key`` (PKCS#8 PEM, mode 0600) and ``NAME.pub`` (base64 raw public key)."""
    keys = signing.generate_keypair()
    out_dir.mkdir(parents=True, exist_ok=True)
    private = out_dir / f"{name}.key"
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(keys.private_pem)
    (out_dir / f"{name}.pub").write_text(keys.public_b64 + "\n")
    return private, keys.public_b64


def _public_key(value: str) -> str:
    """The base64 public key given inline, or read from the ``.pub`` file it names."""
    if Path(value).is_file():
        return Path(value).read_text().strip()
    return value


async def ensure_trusted(nc: NATS, signer: str, public_key: str, tenants: Iterable[str], who: str) -> None:
    """Have ``signer`` trusted with ``public_key`` for ``tenants`` (besides its other tenants),
    rotating it only when that is not already so."""
    wanted = set(tenants)
    known = await request(nc, subjects.registry("keys"), ListKeysRequest(), TrustedKeysReply, TIMEOUT_S)
    record = next((s for s in known.signers if s.signer == signer), None)
    if record and record.trusted and record.public_key == public_key and wanted <= set(record.tenants):
        return
    bound = sorted(wanted | set(record.tenants if record else []))
    message = TrustKeyRequest(signer=signer, public_key=public_key, tenants=bound, rotate=record is not None, actor=who)
    await request(nc, subjects.registry("trust_key"), message, TrustedKeysReply, TIMEOUT_S)


async def _registry_keys(args: argparse.Namespace) -> list[SignerRecord]:
    nc = await cli_connect(args.nats_url)
    try:
        if args.keys_cmd == "trust":
            key = await asyncio.to_thread(_public_key, args.public_key)
            message = TrustKeyRequest(
                signer=args.name, public_key=key, tenants=args.tenant, rotate=args.rotate, actor=actor()
            )
            reply = await request(nc, subjects.registry("trust_key"), message, TrustedKeysReply, TIMEOUT_S)
        elif args.keys_cmd == "untrust":
            untrust = UntrustKeyRequest(signer=args.name, actor=actor())
            reply = await request(nc, subjects.registry("untrust_key"), untrust, TrustedKeysReply, TIMEOUT_S)
        else:
            reply = await request(nc, subjects.registry("keys"), ListKeysRequest(), TrustedKeysReply, TIMEOUT_S)
        return reply.signers
    finally:
        await nc.drain()


def run(args: argparse.Namespace) -> int:
    if args.keys_cmd == "gen":
        private, public = generate(args.name, args.out)
        print(f"private key: {private} (keep it secret)\npublic key:  {public}")
        print(f"trust it with: lorafleet keys trust {args.name} {public} --tenant TENANT")
        return 0
    try:
        signers = asyncio.run(_registry_keys(args))
    except LorafleetError as e:
        print(f"error ({e.code}): {e.message}")
        return 1
    for s in signers:
        state = "trusted" if s.trusted else "untrusted"
        print(f"{s.signer:<24} {s.public_key} {state:<9} tenants={','.join(s.tenants) or '-'}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument("--nats-url", default=os.environ.get("LF_NATS_URL", "nats://127.0.0.1:4222"))
    keys = subparsers.add_parser("keys", help="adapter signing keys")
    keys.set_defaults(func=run)
    sub = keys.add_subparsers(dest="keys_cmd", required=True)
    gen = sub.add_parser("gen", help="make NAME.key and NAME.pub")
    gen.add_argument("name", help="signer name (letters, digits, - and _)")
    gen.add_argument("--out", type=Path, default=Path(".lorafleet/keys"))
    trust = sub.add_parser("trust", parents=[opts], help="trust a signer for the tenants it may sign for")
    trust.add_argument("name")
    trust.add_argument("public_key", help="base64 public key, or the NAME.pub file")
    trust.add_argument("--tenant", action="append", required=True, help="a tenant it may sign for (repeatable)")
    trust.add_argument(
        "--rotate", action="store_true", help="replace a known signer's key or tenants (earlier keys still verify)"
    )
    untrust = sub.add_parser(
        "untrust", parents=[opts], help="refuse new pushes signed by a signer (its versions stay until revoked)"
    )
    untrust.add_argument("name")
    sub.add_parser("list", parents=[opts], help="the registry's signers")
