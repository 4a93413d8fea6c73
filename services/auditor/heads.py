"""The auditor's head-signing key and the signed chain heads it publishes.

The key is the auditor's own, made on first start beside its index (mode 0600) and never sent
anywhere; its public half goes out in every head, and the first head on the AUDIT_HEADS stream,
which refuses deletes and purges, fixes it for good."""

import os
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.auditor.chain import Tip
from shared import signing
from shared.errors import IntegrityError
from shared.schemas import SignedHead


def load_or_create_key(path: Path) -> Ed25519PrivateKey:
    """The key at ``path``; a missing one is made there, readable by its owner only, with its
    public half beside it (``<path>.pub``). A key file others may read is refused."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        pair = signing.generate_keypair()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pair.private_pem)
        path.with_name(path.name + ".pub").write_text(pair.public_b64 + "\n")
    if path.stat().st_mode & 0o077:
        raise IntegrityError(f"the auditor's head key {path} is readable by others (chmod 600 it)")
    return signing.load_private_key(path.read_bytes())


def _statement(head: SignedHead) -> bytes:
    return signing.canonical_json(head.model_dump(mode="json", exclude={"signature"}))


class HeadSigner:
    def __init__(self, auditor_id: str, key: Ed25519PrivateKey):
        self.auditor_id = auditor_id
        self._key = key
        self.public_key = signing.public_key_b64(key)

    def sign(self, tip: Tip) -> SignedHead:
        unsigned = SignedHead(
            auditor_id=self.auditor_id,
            pos=tip.pos,
            hash=tip.hash,
            stream_seq=tip.stream_seq,
            ts=time.time(),
            public_key=self.public_key,
            signature="",
        )
        return unsigned.model_copy(update={"signature": signing.sign(_statement(unsigned), self._key)})

    def check(self, head: SignedHead) -> None:
        """Raise IntegrityError unless this auditor's key signed exactly ``head``."""
        if head.public_key != self.public_key:
            raise IntegrityError(f"the head at record {head.pos} was signed by a key other than this auditor's")
        try:
            signing.verify(_statement(head), head.signature, self.auditor_id, {self.auditor_id: self.public_key})
        except IntegrityError:
            raise IntegrityError(f"the head at record {head.pos} does not match its signature") from None
