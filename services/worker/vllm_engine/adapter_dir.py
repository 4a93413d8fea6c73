"""The worker's private adapter directory: verified adapter files, one folder per weights digest.

vLLM loads a LoRA from a path, so the bytes lorafleet fetched and re-verified are written here
(never the store's path) and vLLM is handed the folder. The root is mode 0700, owned by this
worker, and removed with everything in it at shutdown; a folder leaves when its adapter is evicted."""

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from shared.adapter_format import ADAPTER_FILES, CONFIG_FILE
from shared.errors import IntegrityError
from shared.lora_ranks import checked_patterns

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class AdapterDir:
    """Content-addressed by the sha256 of ``adapter_model.safetensors``; thread-safe for distinct digests."""

    def __init__(self, parent: str | Path | None = None):
        self.root = Path(tempfile.mkdtemp(prefix="lorafleet-vllm-adapters-", dir=parent))
        os.chmod(self.root, 0o700)

    def put(self, digest: str, files: dict[str, bytes]) -> Path:
        """Write one verified adapter's files (``ADAPTER_FILES``, nothing else); its folder.

        ``digest`` is the one the files were verified against (``VerifiedFiles.digest``): not hashed
        again here. An existing folder for the digest is reused: same digest, same verified bytes.
        """
        if not _DIGEST.match(digest):
            raise IntegrityError(f"adapter digest {digest[:80]!r} is not a sha256 hex digest")
        if set(files) != set(ADAPTER_FILES):
            raise IntegrityError(f"adapter files {sorted(files)} are not {sorted(ADAPTER_FILES)}")
        _check_patterns(files[CONFIG_FILE])
        target = self.path_of(digest)
        if target.is_dir():
            return target
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root))
        for name, data in files.items():
            fd = os.open(staging / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        try:
            staging.rename(target)  # atomic: vLLM never sees a half-written folder
        except OSError:
            shutil.rmtree(staging)  # another thread landed the same digest first
        return target

    def remove(self, digest: str) -> None:
        shutil.rmtree(self.path_of(digest), ignore_errors=True)

    def path_of(self, digest: str) -> Path:
        return self.root / digest

    def digests(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if _DIGEST.match(p.name))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _check_patterns(config_bytes: bytes) -> None:
    """vLLM reads ``rank_pattern`` / ``alpha_pattern`` by PEFT's own rule (its ``PEFTHelper``), with a
    regular expression built from each key: only the keys the registry admits reach it (a dotted name,
    at most 64 of them, not with rsLoRA), so no key can make that match backtrack."""
    try:
        config = json.loads(config_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise IntegrityError(f"{CONFIG_FILE} is not valid JSON", param=CONFIG_FILE) from None
    if not isinstance(config, dict):
        raise IntegrityError(f"{CONFIG_FILE} is not a JSON object", param=CONFIG_FILE)
    checked_patterns(config)
