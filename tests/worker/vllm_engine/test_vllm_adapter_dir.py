"""The vLLM engine's private adapter directory (no vllm needed): verified files land content-addressed
under the digest they were verified against, and nothing but a sha256 name and the adapter's two files
is accepted."""

import hashlib
import json
import stat
from pathlib import Path

import pytest

from services.worker.vllm_engine.adapter_dir import AdapterDir
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.errors import IntegrityError

FILES = {CONFIG_FILE: b'{"r": 8}', WEIGHTS_FILE: b"weights"}
DIGEST = hashlib.sha256(FILES[WEIGHTS_FILE]).hexdigest()


@pytest.fixture
def adapters(tmp_path: Path):
    directory = AdapterDir(tmp_path)
    yield directory
    directory.close()


def test_verified_files_land_under_their_digest_once(adapters: AdapterDir) -> None:
    path = adapters.put(DIGEST, FILES)
    assert path == adapters.path_of(DIGEST) and {p.name: p.read_bytes() for p in path.iterdir()} == FILES
    assert adapters.put(DIGEST, FILES) == path and adapters.digests() == [DIGEST]
    assert stat.S_IMODE(adapters.root.stat().st_mode) == 0o700
    adapters.remove(DIGEST)
    assert adapters.digests() == []


@pytest.mark.parametrize("digest", ["../escape", DIGEST.upper(), DIGEST[:63], ""])
def test_a_name_that_is_no_sha256_is_refused(adapters: AdapterDir, digest: str) -> None:
    with pytest.raises(IntegrityError, match="not a sha256 hex digest"):
        adapters.put(digest, FILES)
    assert list(adapters.root.iterdir()) == []


def test_other_files_than_the_adapters_two_are_refused(adapters: AdapterDir) -> None:
    with pytest.raises(IntegrityError, match="are not"):
        adapters.put(DIGEST, {**FILES, "model.py": b"import os"})
    with pytest.raises(IntegrityError, match="are not"):
        adapters.put(DIGEST, {WEIGHTS_FILE: FILES[WEIGHTS_FILE]})
    assert adapters.digests() == []


def test_an_adapter_of_several_ranks_lands_as_written_for_vllm_to_read_its_patterns(adapters: AdapterDir) -> None:
    config = {"r": 8, "lora_alpha": 16, "rank_pattern": {".*\\.gate_up_proj": 16}, "alpha_pattern": {"down_proj": 16}}
    files = {**FILES, CONFIG_FILE: json.dumps(config).encode()}
    path = adapters.put(DIGEST, files)
    assert json.loads((path / CONFIG_FILE).read_bytes()) == config


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"rank_pattern": {"(a+)+$": 16}}, "rank_pattern"),  # a key whose match could backtrack without bound
        ({"alpha_pattern": {"q_proj|v_proj": 16}}, "alpha_pattern"),  # regular-expression syntax beyond a name
        ({"rank_pattern": {"q_proj": 0}}, "rank_pattern"),
        ({"rank_pattern": {"q_proj": 16}, "use_rslora": True}, "use_rslora"),
        ({"rank_pattern": {f"layers.{i}.q_proj": 16 for i in range(65)}}, "rank_pattern"),
    ],
)
def test_a_pattern_the_registry_would_not_admit_is_refused_before_vllm_sees_it(
    adapters: AdapterDir, extra: dict, param: str
) -> None:
    files = {**FILES, CONFIG_FILE: json.dumps({"r": 8, "lora_alpha": 16, **extra}).encode()}
    with pytest.raises(IntegrityError) as refused:
        adapters.put(DIGEST, files)
    assert refused.value.param == param
    assert list(adapters.root.iterdir()) == []


@pytest.mark.parametrize("config", [b"{not json", b"[8]", b"\xff"])
def test_a_config_that_is_not_a_json_object_is_refused(adapters: AdapterDir, config: bytes) -> None:
    with pytest.raises(IntegrityError, match=CONFIG_FILE):
        adapters.put(DIGEST, {**FILES, CONFIG_FILE: config})
    assert list(adapters.root.iterdir()) == []
