"""Hostile adapter files registered straight with the live registry: each refusal is the exact typed
error, stores nothing (no record, no object, no upload left behind) and is audited as a registry
rejection of the tenant that pushed it."""

import hashlib
import io
import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from nats.aio.client import Client as NATS
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from transformers import LlamaConfig, LlamaForCausalLM

from shared import signing, subjects
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.bus import request
from shared.errors import (
    Conflict,
    IntegrityError,
    InvalidRequest,
    LorafleetError,
    PayloadTooLarge,
    SignerNotAuthorized,
)
from shared.schemas import AdapterRecordsReply, RegisterRequest
from tests.helpers.adapters import save_peft_adapter
from tests.hostile.conftest import PICKLE, Files, HostileStack, inline

Edit = Callable[[Files, Path], Files]


def tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Edit:
    def apply(files: Files, _: Path) -> Files:
        loaded = load_tensors(files[WEIGHTS_FILE])
        edit(loaded)
        return {**files, WEIGHTS_FILE: save_tensors(loaded)}

    return apply


def config(**changes: object) -> Edit:
    return lambda files, _: {**files, CONFIG_FILE: json.dumps({**json.loads(files[CONFIG_FILE]), **changes}).encode()}


def config_text(old: str, new: str) -> Edit:
    return lambda files, _: {**files, CONFIG_FILE: files[CONFIG_FILE].replace(old.encode(), new.encode())}


def weights(data: bytes) -> Edit:
    return lambda files, _: {**files, WEIGHTS_FILE: data}


def header(edit: Callable[[dict], None]) -> Edit:
    """Rewrite the safetensors JSON header, keeping the tensor bytes."""

    def apply(files: Files, _: Path) -> Files:
        raw = files[WEIGHTS_FILE]
        (length,) = struct.unpack("<Q", raw[:8])
        parsed = json.loads(raw[8 : 8 + length])
        edit(parsed)
        text = json.dumps(parsed).encode()
        return {**files, WEIGHTS_FILE: struct.pack("<Q", len(text)) + text + raw[8 + length :]}

    return apply


def first_tensor(edit: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda parsed: edit(parsed[min(k for k in parsed if k != "__metadata__")])


def overlap(parsed: dict) -> None:
    names = sorted(k for k in parsed if k != "__metadata__")
    parsed[names[1]]["data_offsets"] = parsed[names[0]]["data_offsets"]


def poisoned(dtype: torch.dtype, value: float, index: int) -> Edit:
    """Every tensor cast to ``dtype``, one element of tensor ``index`` set to ``value``."""

    def edit(loaded: dict[str, torch.Tensor]) -> None:
        for name, tensor in list(loaded.items()):
            loaded[name] = tensor.to(dtype)
        loaded[sorted(loaded)[index]].view(-1)[0] = value

    return tensors(edit)


def wider_base(_: Files, tmp: Path) -> Files:
    """A real PEFT adapter, but for a Llama twice as wide as the registry's base model."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        )
    )
    save_peft_adapter(tmp / "wide", base)
    return {name: (tmp / "wide" / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}


def torch_zip(files: Files, _: Path) -> Files:
    buffer = io.BytesIO()
    torch.save(load_tensors(files[WEIGHTS_FILE]), buffer)
    return {**files, WEIGHTS_FILE: buffer.getvalue()}


FILES = [  # (edit of the good adapter's files, typed error, message fragment)
    pytest.param(poisoned(torch.float32, float("inf"), -1), IntegrityError, "NaN or Inf", id="inf-in-last-f32"),
    pytest.param(poisoned(torch.bfloat16, float("-inf"), 0), IntegrityError, "NaN or Inf", id="minus-inf-in-bf16"),
    pytest.param(poisoned(torch.float16, float("nan"), 1), IntegrityError, "NaN or Inf", id="nan-in-f16"),
    pytest.param(wider_base, IntegrityError, "expected", id="wrong-base-model-shapes"),
    pytest.param(tensors(lambda t: t.pop(min(t))), IntegrityError, "without its pair", id="lora-B-without-A"),
    pytest.param(weights(PICKLE), IntegrityError, "out of bounds", id="pickle-as-safetensors"),
    pytest.param(torch_zip, IntegrityError, "out of bounds", id="torch-zip-as-safetensors"),
    pytest.param(weights(struct.pack("<Q", 2**63) + b"{}"), IntegrityError, "out of bounds", id="header-length-bomb"),
    pytest.param(header(first_tensor(lambda e: e.update(dtype="F64"))), IntegrityError, "dtype", id="dtype-f64"),
    pytest.param(
        header(first_tensor(lambda e: e.update(shape=[2**40, 2**40]))), IntegrityError, "shape", id="shape-2e80"
    ),
    pytest.param(header(overlap), IntegrityError, "overlaps", id="overlapping-tensors"),
    pytest.param(
        header(lambda h: h.update({"lm_head.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})),
        IntegrityError,
        "not a LoRA A/B weight",
        id="extra-lm-head-tensor",
    ),
    pytest.param(
        config(auto_mapping={"base_model_class": "Evil", "parent_library": "evil.module"}),
        InvalidRequest,
        "custom class",
        id="auto-mapping-remote-code",
    ),
    pytest.param(config(target_modules=["lm_head", "q_proj"]), InvalidRequest, "refused", id="target-lm-head"),
    pytest.param(config(target_modules=".*"), InvalidRequest, "refused", id="target-regex"),
    pytest.param(config(r=True), InvalidRequest, "positive integer", id="rank-is-a-bool"),
    pytest.param(
        config_text('"lora_alpha": 16', '"lora_alpha": NaN'), InvalidRequest, "lora_alpha", id="alpha-NaN-token"
    ),
    pytest.param(config(layers_to_transform=[0]), InvalidRequest, "unsupported setting", id="layers-to-transform"),
    pytest.param(config(bias="all"), InvalidRequest, "bias", id="bias-all"),
    pytest.param(config(padding="x" * 70_000), PayloadTooLarge, "byte cap", id="config-over-64KiB"),
    pytest.param(weights(b""), IntegrityError, "too short", id="empty-weights"),
    pytest.param(
        lambda f, _: {**f, "adapter_model.safetensors\x00.bin": f[WEIGHTS_FILE]},
        InvalidRequest,
        "path components",
        id="nul-in-file-name",
    ),
    pytest.param(lambda f, _: {CONFIG_FILE: f[CONFIG_FILE]}, InvalidRequest, "missing", id="weights-missing"),
]


async def assert_refused(
    hostile: HostileStack, nc: NATS, req: RegisterRequest, error: type[LorafleetError], text: str
) -> None:
    """``req`` is refused with ``error``; nothing changed; the registry audited the refusal."""
    before, since = await hostile.snapshot(nc), time.time()
    with pytest.raises(error, match=text) as refused:
        await request(nc, subjects.registry("register"), req, AdapterRecordsReply, 30)
    assert type(refused.value) is error and refused.value.status < 500
    assert await hostile.snapshot(nc) == before
    audit = await hostile.wait_audit(
        "rejection", req.tenant_id, since, service="registry", code=error.code, request_id=f"register.{req.adapter_id}"
    )
    assert audit["reason"].startswith("push refused")


def register(adapter_id: str, **fields: object) -> RegisterRequest:
    return RegisterRequest(adapter_id=adapter_id, tenant_id="demo", task_type="chat", actor="test", **fields)


@pytest.mark.parametrize("edit, error, text", FILES)
async def test_hostile_adapter_files_are_refused(hostile: HostileStack, nc: NATS, tmp_path: Path, edit, error, text):
    files = edit(dict(hostile.files), tmp_path)
    await assert_refused(hostile, nc, register("hostile-files", inline_files=inline(files)), error, text)


def signed(
    hostile: HostileStack,
    key: signing.KeyPair | None = None,
    tenant: str = "demo",
    signer: str = "release",
    fingerprint: str | None = None,
    files: Files | None = None,
) -> dict:
    """Signature fields for version 1 of ``hostile-signed``, signed as ``tenant``'s push."""
    digests = {n: hashlib.sha256(d).hexdigest() for n, d in (files or hostile.files).items()}
    manifest = signing.manifest_bytes(digests, "hostile-signed", 1, tenant, fingerprint or hostile.fingerprint)
    signature = signing.sign(manifest, signing.load_private_key((key or hostile.signer).private_pem))
    return {"signature": signature, "signer": signer, "version": 1}


SIGNATURES = [  # (signature fields, tenant pushing, message fragment)
    pytest.param(lambda h: signed(h, key=signing.generate_keypair()), "demo", "does not match", id="forged-key"),
    pytest.param(lambda h: signed(h, signer="mallory"), "demo", "not a trusted signer", id="untrusted-signer"),
    pytest.param(
        lambda h: {**signed(h), "signature": "!!not base64!!"}, "demo", "not valid base64", id="garbage-signature"
    ),
    pytest.param(lambda h: signed(h, fingerprint="e" * 64), "demo", "does not match", id="signed-for-another-base"),
    pytest.param(lambda h: signed(h, tenant="demo"), "other", "does not match", id="replayed-to-another-tenant"),
    pytest.param(
        lambda h: signed(h, files={**h.files, CONFIG_FILE: h.files[CONFIG_FILE] + b" "}),
        "demo",
        "does not match",
        id="files-swapped-after-signing",
    ),
]


async def test_a_signer_not_bound_to_the_pushing_tenant_is_refused(hostile: HostileStack, nc: NATS) -> None:
    """ "release" may sign for demo only: its valid signature over another tenant's push is refused."""
    req = register("hostile-signed", inline_files=inline(hostile.files), **signed(hostile, tenant="other"))
    await assert_refused(
        hostile, nc, req.model_copy(update={"tenant_id": "other"}), SignerNotAuthorized, "may not sign"
    )


@pytest.mark.parametrize("fields, tenant, text", SIGNATURES)
async def test_forged_signatures_are_refused_even_in_dev_mode(hostile: HostileStack, nc: NATS, fields, tenant, text):
    req = register("hostile-signed", inline_files=inline(hostile.files), **fields(hostile))
    await assert_refused(hostile, nc, req.model_copy(update={"tenant_id": tenant}), IntegrityError, text)


def trusted_source(hostile: HostileStack, name: str, make: Callable[[Path], None]) -> str:
    directory = hostile.trusted_dir / name
    make(directory)
    return directory.as_uri()


def copy_with_symlinked_weights(hostile: HostileStack, directory: Path) -> None:
    directory.mkdir()
    (directory / CONFIG_FILE).write_bytes(hostile.files[CONFIG_FILE])
    outside = directory.parent.parent / f"outside-{directory.name}.safetensors"
    outside.write_bytes(hostile.files[WEIGHTS_FILE])
    os.symlink(outside, directory / WEIGHTS_FILE)


@pytest.mark.parametrize(
    "source, text",
    [
        pytest.param(
            lambda h: trusted_source(h, "to-etc", lambda d: os.symlink("/etc", d)),
            "outside every trusted",
            id="symlinked-directory",
        ),
        pytest.param(
            lambda h: trusted_source(h, "link-file", lambda d: copy_with_symlinked_weights(h, d)),
            "not a symlink",
            id="symlinked-weights",
        ),
        pytest.param(lambda h: h.trusted_dir.as_uri() + "/../../../etc", "outside every trusted", id="dot-dot-uri"),
        pytest.param(
            lambda h: h.trusted_dir.as_uri() + "%2F..%2F..%2Fetc", "outside every trusted", id="encoded-dot-dot-uri"
        ),
        pytest.param(lambda h: "file://evil.example" + str(h.trusted_dir), "remote host", id="remote-host-file-uri"),
    ],
)
async def test_hostile_source_paths_are_refused(hostile: HostileStack, nc: NATS, source, text):
    await assert_refused(hostile, nc, register("hostile-source", source_uri=source(hostile)), InvalidRequest, text)


async def test_taking_another_tenants_adapter_id_is_refused(hostile: HostileStack, nc: NATS):
    req = register("other-secret", inline_files=inline(hostile.files), aliases=["demo-secret"])
    await assert_refused(hostile, nc, req, Conflict, "not available")


async def test_registry_still_admits_a_good_adapter(hostile: HostileStack, nc: NATS):
    reply = await request(
        nc,
        subjects.registry("register"),
        register("hostile-good", inline_files=inline(hostile.files)),
        AdapterRecordsReply,
        30,
    )
    assert [(r.adapter_id, r.status) for r in reply.records] == [("hostile-good", "staging")]
    await hostile.assert_alive()
