"""(tenant, model[@version], request key) -> the base model or the exact adapter version.

An unknown adapter and one the tenant may not use get the same ModelNotFound text, so a
tenant cannot probe which adapter names exist. Access is judged on the version served: a shared
adapter's versions may each name different tenants in their scopes.
"""

from shared.catalog.access import SHARED_TENANT, may_use
from shared.catalog.records import RELEASED, Catalog
from shared.catalog.rollout import choose, split_key
from shared.errors import AdapterNotReleased, AdapterRevoked, ModelNotFound
from shared.schemas import AdapterRecord, ListModelsReply, ModelInfo, ResolvedAdapter, ResolveReply


def not_found(model: str) -> ModelNotFound:
    return ModelNotFound(f"The model '{model}' does not exist or you do not have access to it.", param="model")


def find_adapter(catalog: Catalog, tenant_id: str, name: str) -> str | None:
    """The adapter id ``name`` means for this tenant (id, own alias, then shared alias), if any of
    its versions is visible to the tenant."""
    for candidate in (name, catalog.alias_owner(tenant_id, name), catalog.alias_owner(SHARED_TENANT, name)):
        if candidate and any(may_use(r, tenant_id) for r in catalog.versions(candidate)):
            return candidate
    return None


def _usable(record: AdapterRecord | None, tenant_id: str) -> AdapterRecord | None:
    return record if record is not None and may_use(record, tenant_id) else None


def _split(model: str) -> tuple[str, int | None]:
    name, sep, version = model.partition("@")
    if not sep:
        return name, None
    if not version.isdigit() or int(version) < 1:
        raise ModelNotFound(f"'{model}': a version after @ must be a positive integer", param="model")
    return name, int(version)


def to_resolved(record: AdapterRecord) -> ResolvedAdapter:
    return ResolvedAdapter(
        adapter_id=record.adapter_id,
        version=record.version,
        rank=record.rank,
        digest=record.digest,
        storage_uri=record.storage_uri,
        alpha=record.alpha,
        use_rslora=record.use_rslora,
        target_modules=list(record.target_modules),
    )


def resolve(
    catalog: Catalog, base_model: str, tenant_id: str, model: str, request_key: str, preview: bool = False
) -> ResolveReply:
    """``preview`` lets a pinned ``model@version`` reach a staging version: pre-release evaluation."""
    if model == base_model:
        return ResolveReply(base_model=base_model, adapter=None)
    name, version = _split(model)
    adapter_id = find_adapter(catalog, tenant_id, name)
    if adapter_id is None:
        raise not_found(model)
    if version is not None:
        record = _usable(catalog.get(adapter_id, version), tenant_id)
        if record is None:
            raise not_found(model)
    else:
        production, canary = (_usable(r, tenant_id) for r in catalog.released(adapter_id))
        visible = [r for r in catalog.versions(adapter_id) if may_use(r, tenant_id)]
        record = choose(production, canary, split_key(tenant_id, request_key)) or visible[-1]  # find_adapter saw one
    if record.status == "revoked":
        raise AdapterRevoked(f"'{model}' version {record.version} was revoked and is not served", param="model")
    if record.status not in RELEASED and not (preview and version is not None and record.status == "staging"):
        raise AdapterNotReleased(f"'{model}' has no released version (it is {record.status})", param="model")
    return ResolveReply(base_model=base_model, adapter=to_resolved(record))


def list_models(catalog: Catalog, base_model: str, tenant_id: str, created: int) -> ListModelsReply:
    """The base model plus every released adapter the tenant may use (one entry per adapter)."""
    models = [ModelInfo(id=base_model, owned_by="lorafleet", created=created, kind="base")]
    for adapter_id in sorted(catalog.adapters()):
        production, canary = catalog.released(adapter_id)
        shown = production or canary
        if shown is not None and may_use(shown, tenant_id):
            models.append(
                ModelInfo(id=adapter_id, owned_by=shown.tenant_id, created=int(shown.created_at), kind="adapter")
            )
    return ListModelsReply(models=models)
