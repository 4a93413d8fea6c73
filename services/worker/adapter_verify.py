"""Worker-side trust check: nothing enters adapter memory unless it is exactly what was signed.

The registry already validated the adapter at push time; the worker re-checks the bytes it
actually fetched (digests, signed manifest, base-model fingerprint), because the store or
the path between may have been tampered with since.
"""

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlparse

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared import signing
from shared.adapter_format import ADAPTER_FILES, OBJECT_STORE_SCHEME, file_digests
from shared.bus import read_object
from shared.errors import IntegrityError
from shared.eval_set import EVAL_SET_FILE
from shared.schemas import AdapterRecord


def verify_adapter(
    record: AdapterRecord,
    files: dict[str, bytes],
    base_fingerprint: str,
    trusted_keys: Mapping[str, str | Sequence[str]],
    *,
    require_signature: bool = True,
) -> None:
    """Raise IntegrityError unless ``files`` are the record's files, signed by a trusted key,
    for this worker's base model (``base_fingerprint`` from shared.fingerprint)."""
    if record.status == "revoked":
        raise IntegrityError(f"{record.adapter_id} v{record.version} is revoked")
    if record.base_model_fingerprint != base_fingerprint:
        raise IntegrityError(
            f"{record.adapter_id} v{record.version} was built for base model {record.base_model_fingerprint[:12]}, "
            f"this worker serves {base_fingerprint[:12]}"
        )
    # a pushed eval set is signed with the adapter but never served: its digest enters the manifest as recorded
    signed_only = {n: d for n, d in record.files.items() if n == EVAL_SET_FILE}
    if set(files) != set(record.files) - set(signed_only):
        raise IntegrityError(
            f"{record.adapter_id} v{record.version}: fetched {sorted(files)}, expected {sorted(record.files)}"
        )
    digests = file_digests(files)
    for name, digest in digests.items():
        if digest != record.files[name]:
            raise IntegrityError(f"{record.adapter_id} v{record.version}: {name} sha256 {digest[:12]} does not match")
    if digests.get("adapter_model.safetensors") != record.digest:
        raise IntegrityError(f"{record.adapter_id} v{record.version}: weights digest does not match the record")
    manifest = signing.manifest_bytes(
        {**digests, **signed_only}, record.adapter_id, record.version, record.tenant_id, base_fingerprint
    )
    if signing.manifest_digest(manifest) != record.manifest_digest:
        raise IntegrityError(f"{record.adapter_id} v{record.version}: manifest digest does not match the record")
    if record.signature is None or record.signer is None:
        if require_signature:
            raise IntegrityError(f"{record.adapter_id} v{record.version} is unsigned")
        return
    signing.verify(manifest, record.signature, record.signer, trusted_keys)


async def fetch_adapter_files(js: JetStreamContext, storage_uri: str) -> dict[str, bytes]:
    """Read the adapter's files from ``nats-os://<bucket>/<id>/<version>`` or ``file:///dir``."""
    parsed = urlparse(storage_uri)
    if parsed.scheme == OBJECT_STORE_SCHEME:
        store = await js.object_store(parsed.netloc)
        prefix = parsed.path.strip("/")
        files: dict[str, bytes] = {}
        for name in ADAPTER_FILES:
            try:
                files[name] = await read_object(store, f"{prefix}/{name}")
            except NotFoundError:
                raise IntegrityError(f"{storage_uri}: {name} is missing from the store") from None
        return files
    if parsed.scheme == "file":
        return _read_dir(Path(parsed.path), storage_uri)
    raise IntegrityError(f"storage URI {storage_uri!r} is not a trusted store")


def _read_dir(directory: Path, uri: str) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for name in ADAPTER_FILES:
        path = directory / name
        if path.is_symlink() or not path.is_file():
            raise IntegrityError(f"{uri}: {name} is missing or not a regular file")
        with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW)) as f:
            files[name] = f.read()
    return files


async def fetch_verified(
    js: JetStreamContext,
    record: AdapterRecord,
    base_fingerprint: str,
    trusted_keys: Mapping[str, str | Sequence[str]],
    *,
    require_signature: bool = True,
) -> dict[str, bytes]:
    """Fetch the record's files and verify them; the only way a worker should obtain adapter bytes."""
    files = await fetch_adapter_files(js, record.storage_uri)
    verify_adapter(record, files, base_fingerprint, trusted_keys, require_signature=require_signature)
    return files
