"""``CatalogView`` (every service's read model of the registry): successes answered locally, every
refusal asked of the registry, and the barrier's wait for a revision."""

import asyncio

import pytest

from shared.catalog.records import Catalog
from shared.catalog.resolve import resolve
from shared.catalog.view import AskRegistry, CatalogView
from shared.errors import LorafleetError
from shared.schemas import ResolveReply, ResolveRequest
from tests.helpers.records import make_record

BASE = "tiny-llama"


def loaded_mirror(*records, ask: AskRegistry | None = None) -> CatalogView:
    mirror = CatalogView(ask) if ask is not None else CatalogView()
    for revision, record in enumerate(records, start=1):
        mirror.apply(f"{record.adapter_id}.{record.version}", record.model_dump_json().encode(), revision)
    mirror.mark_loaded()
    return mirror


class Registry:
    """The registry's side of a resolve: the same pure function over its own (newest) catalog."""

    def __init__(self, *records) -> None:
        self.catalog = Catalog(records)
        self.asked: list[ResolveRequest] = []

    async def __call__(self, req: ResolveRequest) -> ResolveReply:
        self.asked.append(req)
        return resolve(self.catalog, BASE, req.tenant_id, req.model, req.request_key, req.preview)


SUM_V1 = make_record("acme-sum", 1, "acme", status="production", traffic_percent=100, aliases=["sum"])
SUM_V2_CANARY = make_record("acme-sum", 2, "acme", status="canary", traffic_percent=30)


async def test_a_loaded_mirror_answers_successes_without_the_registry():
    registry = Registry(SUM_V1)
    resolver = loaded_mirror(SUM_V1, ask=registry)
    first = await resolver.resolve(ResolveRequest(tenant_id="acme", model="sum", request_key="k"))
    assert first.adapter.adapter_id == "acme-sum" and first.base_model == BASE
    assert len(registry.asked) == 1  # the base model's name is learnt from the registry's first answer
    for model in ("sum", "acme-sum", "acme-sum@1", BASE):
        reply = await resolver.resolve(ResolveRequest(tenant_id="acme", model=model, request_key="k"))
        assert reply == await registry(ResolveRequest(tenant_id="acme", model=model, request_key="k"))
    assert len(registry.asked) == 1 + 4  # only the comparisons above


async def test_the_mirror_splits_canary_traffic_as_the_registry_does():
    registry = Registry(SUM_V1, SUM_V2_CANARY)
    resolver = loaded_mirror(SUM_V1, SUM_V2_CANARY, ask=registry)
    resolver.base_model = BASE
    for i in range(200):
        req = ResolveRequest(tenant_id="acme", model="sum", request_key=f"user-{i}")
        local = await resolver.resolve(req)
        assert local == await registry(req)
    versions = {
        (await resolver.resolve(ResolveRequest(tenant_id="acme", model="sum", request_key=f"u{i}"))).adapter.version
        for i in range(200)
    }
    assert versions == {1, 2}


@pytest.mark.parametrize(
    ("model", "code"),
    [
        ("globex-sql", "model_not_found"),
        ("nobody", "model_not_found"),
        ("acme-sum@7", "model_not_found"),
        ("acme-draft", "adapter_not_released"),
    ],
)
async def test_every_refusal_is_the_registrys_answer(model, code):
    records = (
        SUM_V1,
        make_record("globex-sql", 1, "globex", status="production", traffic_percent=100),
        make_record("acme-draft", 1, "acme"),
    )
    registry = Registry(*records)
    resolver = loaded_mirror(*records, ask=registry)
    resolver.base_model = BASE
    with pytest.raises(LorafleetError) as info:
        await resolver.resolve(ResolveRequest(tenant_id="acme", model=model, request_key="k"))
    assert info.value.code == code
    assert [r.model for r in registry.asked] == [model]  # asked (and, for a foreign one, audited) there


async def test_an_adapter_the_mirror_has_not_seen_yet_is_resolved_by_the_registry():
    new = make_record("acme-new", 1, "acme", status="production", traffic_percent=100)
    registry = Registry(SUM_V1, new)
    resolver = loaded_mirror(SUM_V1, ask=registry)
    resolver.base_model = BASE
    reply = await resolver.resolve(ResolveRequest(tenant_id="acme", model="acme-new", request_key="k"))
    assert reply.adapter.adapter_id == "acme-new" and len(registry.asked) == 1


async def test_an_unloaded_mirror_asks_the_registry():
    registry = Registry(SUM_V1)
    mirror = CatalogView(registry)
    mirror.apply("acme-sum.1", SUM_V1.model_dump_json().encode(), 1)  # still loading
    mirror.base_model = BASE
    await mirror.resolve(ResolveRequest(tenant_id="acme", model="sum", request_key="k"))
    assert len(registry.asked) == 1


async def test_caught_up_waits_for_the_revision_and_gives_up_after_the_bound():
    mirror = loaded_mirror(SUM_V1)
    assert await mirror.caught_up(1, 0.01)
    assert not await mirror.caught_up(2, 0.05)
    assert mirror._waiters == []  # a wait that gave up leaves nothing behind
    waiting = asyncio.create_task(mirror.caught_up(3, 5))
    await asyncio.sleep(0.01)
    mirror.apply("acme-sum.2", SUM_V2_CANARY.model_dump_json().encode(), 2)
    await asyncio.sleep(0.01)
    assert not waiting.done()
    mirror.apply("acme-sum.2", SUM_V2_CANARY.model_dump_json().encode(), 3)
    assert await asyncio.wait_for(waiting, 1)
    assert mirror.catalog.get("acme-sum", 2).status == "canary"


async def test_a_mirror_still_loading_is_not_caught_up():
    mirror = CatalogView()
    mirror.apply("acme-sum.1", SUM_V1.model_dump_json().encode(), 5)
    assert not await mirror.caught_up(1, 0.02)
    mirror.mark_loaded()
    assert await mirror.caught_up(1, 0.02)


async def test_a_shared_adapters_scopes_are_judged_on_the_version_served():
    """v1 (production) names acme, v2 (the newest, a full canary) names globex: each tenant gets the
    version its scope names, never one that does not name it (before: judged on the newest only)."""
    v1 = make_record("shared-chat", 1, "shared", status="production", allowed_scopes=["acme"])
    v2 = make_record("shared-chat", 2, "shared", status="canary", traffic_percent=100, allowed_scopes=["globex"])
    registry = Registry(v1, v2)
    resolver = loaded_mirror(v1, v2, ask=registry)
    resolver.base_model = BASE
    for tenant, version in (("acme", 1), ("globex", 2)):
        reply = await resolver.resolve(ResolveRequest(tenant_id=tenant, model="shared-chat", request_key="k"))
        assert reply.adapter is not None and reply.adapter.version == version
    for tenant, model in (("acme", "shared-chat@2"), ("globex", "shared-chat@1")):
        with pytest.raises(LorafleetError, match="does not exist"):
            await resolver.resolve(ResolveRequest(tenant_id=tenant, model=model, request_key="k"))


async def test_a_refusal_asked_of_the_registry_names_the_views_route():
    """The registry audits a foreign attempt under the path that asked (a scheduler's view: nats)."""
    registry = Registry(SUM_V1)
    view = CatalogView(registry, route="nats")
    view.mark_loaded()
    view.base_model = BASE
    with pytest.raises(LorafleetError, match="does not exist"):
        await view.resolve(ResolveRequest(tenant_id="other", model="sum", request_key="k"))
    assert [r.route for r in registry.asked] == ["nats"]
