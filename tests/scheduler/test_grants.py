"""The scheduler resolves a submission's ``model`` as the gateway does (alias, @version, canary split
by request key, access on the version served, release status) and refuses a client-written adapter
block that is not that resolution; a lagging mirror is settled by the registry's answer."""

import pytest

from shared.catalog.grants import Grants, IsolationAttempt
from shared.catalog.records import Catalog
from shared.catalog.resolve import resolve, to_resolved
from shared.catalog.rollout import in_canary, split_key
from shared.catalog.view import CatalogView
from shared.errors import AdapterNotReleased, AdapterRevoked, IntegrityError, InvalidRequest, ModelNotFound
from shared.schemas import InferRequest, ResolveReply, ResolveRequest
from tests.helpers.records import make_record

BASE = "tiny-llama"
PROD = make_record("acme-sum", 1, "acme", status="production", traffic_percent=100, aliases=["sum"])
CANARY = make_record("acme-sum", 2, "acme", status="canary", traffic_percent=50)
STAGING = make_record("acme-sum", 3, "acme")
RETIRED = make_record("acme-old", 1, "acme", status="retired")
REVOKED = make_record("acme-old", 2, "acme", status="revoked")
OTHERS = make_record("other-secret", 1, "other", status="production", traffic_percent=100)
# a shared adapter whose versions name different tenants: access is judged on the version served
SHARED_V1 = make_record("shared-chat", 1, "shared", status="production", allowed_scopes=["acme"])
SHARED_V2 = make_record("shared-chat", 2, "shared", status="canary", traffic_percent=100, allowed_scopes=["globex"])
RECORDS = (PROD, CANARY, STAGING, RETIRED, REVOKED, OTHERS, SHARED_V1, SHARED_V2)


class Registry:
    def __init__(self, *records) -> None:
        self.catalog = Catalog(records)
        self.asked = 0

    async def __call__(self, req: ResolveRequest) -> ResolveReply:
        self.asked += 1
        return resolve(self.catalog, BASE, req.tenant_id, req.model, req.request_key, req.preview)


def grants(mirror_records=RECORDS, registry_records=RECORDS) -> tuple[Grants, Registry]:
    registry = Registry(*registry_records)
    mirror = CatalogView(registry)
    for revision, record in enumerate(mirror_records, start=1):
        mirror.apply(f"{record.adapter_id}.{record.version}", record.model_dump_json().encode(), revision)
    mirror.mark_loaded()
    mirror.base_model = BASE
    return Grants(mirror.resolve, mirror.catalog), registry


def submission(model: str, tenant: str = "acme", **over) -> InferRequest:
    fields = {
        "request_id": "r1",
        "tenant_id": tenant,
        "model": model,
        "base_model": BASE,
        "prompt": "hi",
        "reply_to": f"_INBOX_{tenant}.r1",
    }
    return InferRequest(**{**fields, **over})


def key_in(canary: bool) -> str:
    return next(f"user{i}" for i in range(1000) if in_canary("acme-sum", split_key("acme", f"user{i}"), 50) == canary)


async def test_a_model_name_without_an_adapter_block_is_served_its_adapter_not_the_base():
    g, _ = grants()
    served = await g.grant(submission("sum", request_key=key_in(canary=False)), preview=False)
    assert served.adapter == to_resolved(PROD)
    canary = await g.grant(submission("acme-sum", request_key=key_in(canary=True)), preview=False)
    assert canary.adapter == to_resolved(CANARY)  # split by the request key, as the gateway splits it


async def test_the_gateways_own_block_is_accepted_and_a_different_one_refused():
    g, _ = grants()
    key = key_in(canary=False)
    assert (await g.grant(submission("sum", request_key=key, adapter=to_resolved(PROD)), False)).adapter
    forged = to_resolved(PROD).model_copy(update={"rank": 64})
    with pytest.raises(IntegrityError):
        await g.grant(submission("sum", request_key=key, adapter=forged), False)
    with pytest.raises(IntegrityError):  # the staging version smuggled in under a released name
        await g.grant(submission("sum", request_key=key, adapter=to_resolved(STAGING)), False)
    with pytest.raises(IntegrityError):  # an adapter block on a base-model request
        await g.grant(submission(BASE, adapter=to_resolved(PROD)), False)


@pytest.mark.parametrize(
    "model, error",
    [
        ("acme-sum@3", AdapterNotReleased),  # staging
        ("acme-old@1", AdapterNotReleased),  # retired
        ("acme-old@2", AdapterRevoked),
        ("acme-old", AdapterRevoked),  # its newest version
        ("other-secret", ModelNotFound),
        ("nothing-here", ModelNotFound),
        ("acme-sum@9", ModelNotFound),
    ],
)
async def test_unreleased_foreign_and_unknown_versions_are_refused(model, error):
    g, registry = grants()
    with pytest.raises(error):
        await g.grant(submission(model), preview=False)
    assert registry.asked == 1  # every refusal is the registry's (it audits foreign attempts)


async def test_a_pinned_staging_version_needs_the_preview_subject():
    g, _ = grants()
    assert (await g.grant(submission("acme-sum@3"), preview=True)).adapter == to_resolved(STAGING)
    with pytest.raises(AdapterNotReleased):
        await g.grant(submission("acme-old@1"), preview=True)  # retired stays retired


async def test_access_is_judged_on_the_version_served():
    g, _ = grants()
    assert (await g.grant(submission("shared-chat"), False)).adapter == to_resolved(SHARED_V1)
    assert (await g.grant(submission("shared-chat", tenant="globex"), False)).adapter == to_resolved(SHARED_V2)
    with pytest.raises(ModelNotFound):
        await g.grant(submission("shared-chat@2"), False)
    with pytest.raises(ModelNotFound):
        await g.grant(submission("shared-chat@1", tenant="globex"), False)


async def test_another_tenants_adapter_block_is_an_isolation_attempt_answered_as_not_found():
    g, _ = grants()
    with pytest.raises(IsolationAttempt) as caught:
        await g.grant(submission("any-name", adapter=to_resolved(OTHERS)), False)
    assert isinstance(caught.value.answer, ModelNotFound)


async def test_a_lagging_mirror_defers_to_the_registry_before_refusing():
    promoted = CANARY.model_copy(update={"status": "production", "traffic_percent": 100})
    retired = PROD.model_copy(update={"status": "retired"})
    g, registry = grants(registry_records=(retired, promoted, STAGING))
    served = await g.grant(submission("sum", adapter=to_resolved(promoted)), False)  # the gateway saw the promote
    assert served.adapter == to_resolved(promoted) and registry.asked == 1


async def test_the_base_model_must_be_the_deployments():
    g, _ = grants()
    with pytest.raises(InvalidRequest):
        await g.grant(submission("sum", base_model="some-other-base"), False)


def test_the_canary_split_is_by_tenant_and_key_so_one_tenant_cannot_pick_anothers_version():
    """Before issue 47 the split key was the client's ``user`` alone: a key in the canary's buckets
    was in them for every tenant, and one tenant steered requests onto a shared canary at will."""
    catalog = Catalog(RECORDS)
    key = next(
        f"user{i}"
        for i in range(10_000)
        if in_canary("acme-sum", f"user{i}", 50) and not in_canary("acme-sum", split_key("acme", f"user{i}"), 50)
    )
    assert resolve(catalog, BASE, "acme", "sum", key).adapter == to_resolved(PROD)
    inside = next(f"user{i}" for i in range(10_000) if in_canary("acme-sum", split_key("acme", f"user{i}"), 50))
    assert resolve(catalog, BASE, "acme", "sum", inside).adapter == to_resolved(CANARY)
