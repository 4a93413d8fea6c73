"""Admit a new adapter version: validate the files, verify the signature, fix its identity.

Pure: the service fetches the files and stores them only after ``admit`` returns, so any
refusal leaves nothing behind.
"""

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from services.registry.fleet_ranks import RankClasses
from services.registry.stores import object_prefix
from shared import signing
from shared.adapter_format import WEIGHTS_FILE, AdapterBytes, AdapterLimits, validate_adapter
from shared.catalog.access import SHARED_TENANT
from shared.catalog.records import Catalog, Change
from shared.errors import Conflict, IntegrityError, RankNotServed, SignerNotAuthorized
from shared.eval_set import EVAL_SET_FILE
from shared.fingerprint import BaseModelSpec
from shared.schemas import AdapterRecord, RegisterRequest, SignerRecord, SourceOrigin
from shared.slot_size import slot_bytes


@dataclass(frozen=True, slots=True)
class BaseModelIdentity:
    """The one base model this registry admits adapters for."""

    name: str
    fingerprint: str
    spec: BaseModelSpec


@dataclass(frozen=True, slots=True)
class IntakePolicy:
    limits: AdapterLimits
    dev_mode: bool  # admits unsigned adapters; never in production
    slot_element_bytes: int = 4  # bytes per weight in the workers' slots (LF_FLEET_SLOT_DTYPE)


def _slot_bytes(
    rank: int, modules: list[str], base: BaseModelSpec, fleet: RankClasses, element_bytes: int
) -> dict[str, int]:
    """Rank class -> one slot's bytes, for every fleet class that holds ``rank``; refuses a rank none holds."""
    sizes = slot_bytes(rank, fleet.classes, base.layer_dims(), modules, element_bytes)
    if not sizes:
        raise RankNotServed(
            f"rank {rank} fits no rank class of the fleet: classes {fleet.describe()}; the largest holds rank "
            f"{max(fleet.classes, default=0)}",
            param="r",
        )
    return {str(c): size for c, size in sizes.items()}


def _check_identity(catalog: Catalog, req: RegisterRequest) -> int:
    """The version this request registers, refusing a taken id, version or alias."""
    owner = catalog.owner(req.adapter_id)
    if owner is not None and owner != req.tenant_id:
        raise Conflict(f"adapter id {req.adapter_id!r} is not available")
    latest = catalog.latest(req.adapter_id)
    next_version = latest.version + 1 if latest else 1
    if req.version is not None and req.version < next_version:
        raise Conflict(
            f"{req.adapter_id} v{req.version} exists or is older than v{next_version}; versions are immutable"
        )
    for alias in req.aliases:
        holder = catalog.alias_owner(req.tenant_id, alias)
        taken_as_id = alias != req.adapter_id and catalog.owner(alias) == req.tenant_id
        if (holder is not None and holder != req.adapter_id) or taken_as_id:
            raise Conflict(f"alias {alias!r} already names another adapter of tenant {req.tenant_id}")
    if req.allowed_scopes and req.tenant_id != SHARED_TENANT:
        raise Conflict("allowed_scopes only apply to adapters of the 'shared' tenant")
    return req.version or next_version


def stored_push(catalog: Catalog, req: RegisterRequest, digests: Mapping[str, str]) -> AdapterRecord | None:
    """The stored version of exactly this push, when a client retries one that was stored (its
    answer lost to a timeout, or to the replica that stored it dying), answered again instead of
    refused as a taken version or stored twice:

    - a push key (signed or not) names one push: the version stored under it, if its files are
      these; the same key with other files is refused (a client reusing keys would lose a push);
    - a signed push without one: the signature covers the files' digests, the id, the version, the
      tenant and the base, so the same signature by the same signer is the same push."""
    if req.push_key is not None:
        for stored in catalog.versions(req.adapter_id):
            if stored.push_key != req.push_key or stored.tenant_id != req.tenant_id:
                continue
            if stored.files != dict(digests):
                raise Conflict(
                    f"push key {req.push_key!r} already stored {req.adapter_id} v{stored.version} with other "
                    "files; a new push needs a new key",
                    param="push_key",
                )
            return stored
        return None
    if req.version is None or req.signature is None:
        return None
    signed = catalog.get(req.adapter_id, req.version)
    if signed is None or (signed.signature, signed.signer, signed.tenant_id) != (
        req.signature,
        req.signer,
        req.tenant_id,
    ):
        return None
    return signed


def admit(
    catalog: Catalog,
    req: RegisterRequest,
    files: Mapping[str, AdapterBytes],
    base: BaseModelIdentity,
    policy: IntakePolicy,
    signers: Mapping[str, SignerRecord],
    storage_uri: str,
    origin: SourceOrigin | None = None,
    *,
    digests: Mapping[str, str],
    fleet: RankClasses,
) -> Change:
    """The staging record of a new version, or a typed error saying what is wrong. ``digests`` are
    ``files``' sha256s (``file_digests``, or taken while a remote fetch streamed them). A signed push
    needs a trusted signer, its current key, and a signer bound to the pushing tenant; its rank
    needs a class of the ``fleet`` that holds it. Every source (upload, inline, trusted directory,
    remote fetch) passes through here alike."""
    version = _check_identity(catalog, req)
    summary = validate_adapter(files, base.spec, policy.limits)
    sizes = _slot_bytes(summary.rank, list(summary.target_modules), base.spec, fleet, policy.slot_element_bytes)
    manifest = signing.manifest_bytes(digests, req.adapter_id, version, req.tenant_id, base.fingerprint)
    if req.signature is not None and req.signer is not None:
        signer = signers.get(req.signer)
        if signer is None or not signer.trusted:
            raise IntegrityError(f"signer {req.signer!r} is not a trusted signer")
        signing.verify(manifest, req.signature, req.signer, {req.signer: signer.public_key})
        if req.tenant_id not in signer.tenants:
            raise SignerNotAuthorized(f"signer {req.signer!r} may not sign adapters of tenant {req.tenant_id}")
    elif not policy.dev_mode:
        raise IntegrityError("the adapter is unsigned; only a registry in dev mode admits unsigned adapters")
    record = AdapterRecord(
        adapter_id=req.adapter_id,
        version=version,
        tenant_id=req.tenant_id,
        base_model=base.name,
        base_model_fingerprint=base.fingerprint,
        task_type=req.task_type,
        rank=summary.rank,
        alpha=summary.alpha,
        use_rslora=summary.use_rslora,
        target_modules=list(summary.target_modules),
        files=dict(digests),
        digest=digests[WEIGHTS_FILE],
        manifest_digest=signing.manifest_digest(manifest),
        signature=req.signature,
        signer=req.signer,
        storage_uri=storage_uri,
        allowed_scopes=req.allowed_scopes,
        aliases=req.aliases,
        eval_results=req.eval_results,
        eval_set_digest=digests.get(EVAL_SET_FILE),
        origin=origin,
        push_key=req.push_key,
        slot_bytes=sizes,
    )
    return Change(kind="registered", before=None, after=record)


def push_prefix(view: Catalog, req: RegisterRequest, tenant_id: str | None = None) -> str:
    """Where a push's files go: its next version's prefix, with this attempt's own token in it."""
    return object_prefix(req.adapter_id, next_version(view, req), tenant_id, uuid.uuid4().hex[:12])


def next_version(catalog: Catalog, req: RegisterRequest) -> int:
    """The version a push becomes: the one it names, else one past the adapter's latest."""
    latest = catalog.latest(req.adapter_id)
    return req.version or (latest.version + 1 if latest else 1)
