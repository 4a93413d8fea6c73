"""Where adapter bytes come from and go to: uploads, the approved store, trusted sources.

The approved store is a JetStream object store (``nats-os://<bucket>/<id>/<version>``) or a
local trusted directory (``file:///dir/<id>/<version>``); workers read the same URIs
(services/worker/adapter_verify.py). A version fetched from a remote source is stored under its
tenant's own prefix (``tenants/<tenant>/<id>/<version>``); remote fetching is remote_fetch.py's.
"""

import asyncio
import base64
import binascii
import contextlib
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlparse

from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from shared import subjects
from shared.adapter_format import ADAPTER_FILES, OBJECT_STORE_SCHEME, AdapterLimits
from shared.bus import ensure_replicas, read_object, settling
from shared.errors import InvalidRequest, NotFound
from shared.eval_set import EVAL_SET_FILE, MAX_EVAL_SET_BYTES

EVAL_SETS = "eval-sets"  # content-addressed: every version's eval set, under its sha256


def object_prefix(adapter_id: str, version: int, tenant_id: str | None = None, attempt: str | None = None) -> str:
    """Where a version's files lie in the store; under ``tenants/<tenant>/`` when fetched remotely.
    ``attempt`` (the registry's per-push token) keeps two replicas that planned the same version at
    once from writing over each other's files: only the one whose record commits is referenced."""
    leaf = f"{version}.{attempt}" if attempt else str(version)
    if tenant_id is not None:
        return f"tenants/{tenant_id}/{adapter_id}/{leaf}"
    return f"{adapter_id}/{leaf}"


@settling
async def open_object_store(js: JetStreamContext, bucket: str, replicas: int | None = None) -> ObjectStore:
    """The object store (file storage, ``LF_JETSTREAM_REPLICAS`` copies), created when missing."""
    wanted = await ensure_replicas(js, f"OBJ_{bucket}", replicas)
    config = ObjectStoreConfig(bucket=bucket, storage=StorageType.FILE, replicas=wanted)
    store = await js.create_object_store(bucket, config=config)
    await ensure_replicas(js, f"OBJ_{bucket}", wanted, check=True)
    return store


def decode_inline(files: dict[str, str]) -> dict[str, bytes]:
    try:
        return {name: base64.b64decode(data, validate=True) for name, data in files.items()}
    except binascii.Error:
        raise InvalidRequest("inline_files must hold base64 file contents") from None


def is_local_source(uri: str) -> bool:
    return urlparse(uri).scheme == "file"


def trusted_source_dir(uri: str, trusted_dirs: tuple[Path, ...]) -> Path:
    """The local directory a ``file://`` source names, if inside a trusted directory."""
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        raise InvalidRequest(f"source {uri!r} is not a file:// source")
    if parsed.netloc not in ("", "localhost"):
        raise InvalidRequest(f"source {uri!r} is refused: a file:// source may not name a remote host")
    path = Path(os.path.realpath(parsed.path))
    for root in trusted_dirs:
        if path.is_relative_to(os.path.realpath(root)):
            return path
    raise InvalidRequest(f"source {uri!r} is outside every trusted directory")


class Uploads:
    """The bucket clients put ``<upload_id>/<file>`` objects into before calling register."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store

    async def read(self, upload_id: str, limits: AdapterLimits) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        for name in ADAPTER_FILES:
            try:
                info = await self._store.get_info(f"{upload_id}/{name}")
            except NotFoundError:
                raise InvalidRequest(f"upload {upload_id!r} has no {name}") from None
            assert info.size is not None, "the server reports the size of every stored object"
            if info.size > limits.max_weights_bytes:
                raise InvalidRequest(f"upload {upload_id!r}: {name} exceeds the size cap")
            files[name] = await read_object(self._store, f"{upload_id}/{name}")
        try:  # optional: the version's own eval set, signed with it
            info = await self._store.get_info(f"{upload_id}/{EVAL_SET_FILE}")
        except NotFoundError:
            return files
        if info.size is None or info.size > MAX_EVAL_SET_BYTES:
            raise InvalidRequest(f"upload {upload_id!r}: {EVAL_SET_FILE} exceeds {MAX_EVAL_SET_BYTES} bytes")
        files[EVAL_SET_FILE] = await read_object(self._store, f"{upload_id}/{EVAL_SET_FILE}")
        return files

    async def delete(self, upload_id: str) -> None:
        for name in (*ADAPTER_FILES, EVAL_SET_FILE):
            with contextlib.suppress(NotFoundError):
                await self._store.delete(f"{upload_id}/{name}")


class ApprovedStore:
    """Writes admitted adapter files to the object store, or to a trusted directory."""

    def __init__(self, objects: ObjectStore | None, bucket: str, file_dir: Path | None) -> None:
        self._objects = objects
        self._bucket = bucket
        self._file_dir = file_dir

    def uri(self, prefix: str) -> str:
        """The storage URI of the files under ``prefix`` (an ``object_prefix``)."""
        if self._file_dir is not None:
            return (self._file_dir.resolve() / prefix).as_uri()
        return f"{OBJECT_STORE_SCHEME}://{self._bucket}/{prefix}"

    async def put(self, prefix: str, files: Mapping[str, bytes | Path]) -> None:
        """Store each file's bytes, or the file at a path, streamed from disk."""
        if self._file_dir is not None:
            target = self._file_dir / prefix
            target.mkdir(parents=True, exist_ok=False)
            for name, data in files.items():
                if isinstance(data, Path):
                    await asyncio.to_thread(shutil.copyfile, data, target / name)
                else:
                    (target / name).write_bytes(data)
            return
        assert self._objects is not None
        for name, data in files.items():
            if isinstance(data, Path):
                with data.open("rb") as reader:  # nats-py reads it chunk by chunk
                    await self._objects.put(f"{prefix}/{name}", reader)
            else:
                await self._objects.put(f"{prefix}/{name}", data)

    async def put_eval_set(self, digest: str, data: bytes) -> None:
        """Keep an eval set by its sha256 (``eval-sets/<digest>``): pushed with a version, or attached later."""
        if self._file_dir is not None:
            target = self._file_dir / EVAL_SETS / digest
            target.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(target.write_bytes, data)
            return
        assert self._objects is not None
        await self._objects.put(f"{EVAL_SETS}/{digest}", data)

    async def eval_set(self, digest: str) -> bytes:
        if self._file_dir is not None:
            path = self._file_dir / EVAL_SETS / digest
            if not path.is_file():
                raise NotFound(f"eval set {digest[:12]} is not in the store")
            return await asyncio.to_thread(path.read_bytes)
        assert self._objects is not None
        try:
            return await read_object(self._objects, f"{EVAL_SETS}/{digest}")
        except NotFoundError:
            raise NotFound(f"eval set {digest[:12]} is not in the store") from None

    async def delete(self, prefix: str, names: Iterable[str]) -> None:
        """Remove the files a push stored under ``prefix`` whose record did not commit."""
        if self._file_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._file_dir / prefix, True)
            return
        assert self._objects is not None
        for name in names:
            with contextlib.suppress(NotFoundError):
                await self._objects.delete(f"{prefix}/{name}")


async def open_approved_store(js: JetStreamContext, file_dir: str | None) -> ApprovedStore:
    if file_dir:
        return ApprovedStore(None, subjects.ADAPTER_STORE_BUCKET, Path(file_dir))
    objects = await open_object_store(js, subjects.ADAPTER_STORE_BUCKET)
    return ApprovedStore(objects, subjects.ADAPTER_STORE_BUCKET, None)
