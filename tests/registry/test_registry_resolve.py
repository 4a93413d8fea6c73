"""Resolution and permission: no existence leak, shared scopes, released versions only."""

from collections.abc import Callable

import pytest

from shared.catalog.records import Catalog
from shared.catalog.resolve import list_models, resolve
from shared.errors import AdapterNotReleased, AdapterRevoked, ModelNotFound
from shared.schemas import AdapterRecord

BASE = "tiny-llama"


@pytest.fixture
def catalog(make_record: Callable[..., AdapterRecord]) -> Catalog:
    return Catalog([
        make_record("acme-sum", 1, "acme", status="production", traffic_percent=100, aliases=["sum"]),
        make_record("acme-sum", 2, "acme", status="revoked"),
        make_record("acme-draft", 1, "acme"),
        make_record("globex-sql", 1, "globex", status="production", traffic_percent=100),
        make_record("shared-chat", 1, "shared", status="production", traffic_percent=100, allowed_scopes=["acme"],
                    aliases=["chat"]),
        make_record("shared-all", 1, "shared", status="production", traffic_percent=100, allowed_scopes=["*"]),
    ])  # fmt: skip


def error_of(catalog: Catalog, tenant: str, model: str) -> tuple[type, str, int]:
    with pytest.raises(ModelNotFound) as info:
        resolve(catalog, BASE, tenant, model, "key")
    return type(info.value), info.value.message, info.value.status


def test_unknown_and_foreign_adapters_get_identical_errors(catalog: Catalog) -> None:
    foreign = error_of(catalog, "acme", "globex-sql")
    unknown = error_of(catalog, "acme", "globex-sql".replace("globex", "nobody"))
    assert foreign[0] is unknown[0] is ModelNotFound
    assert foreign[1].replace("globex", "nobody") == unknown[1]
    assert foreign[2] == unknown[2] == 404
    assert error_of(catalog, "globex", "chat")[1] == "The model 'chat' does not exist or you do not have access to it."
    assert error_of(catalog, "acme", "globex-sql@1")[0] is ModelNotFound


def test_base_model_resolves_to_no_adapter(catalog: Catalog) -> None:
    reply = resolve(catalog, BASE, "acme", BASE, "key")
    assert (reply.base_model, reply.adapter) == (BASE, None)


def test_owner_id_alias_and_pinned_version(catalog: Catalog) -> None:
    for name in ("acme-sum", "sum", "acme-sum@1"):
        adapter = resolve(catalog, BASE, "acme", name, "key").adapter
        assert adapter is not None and (adapter.adapter_id, adapter.version) == ("acme-sum", 1)


def test_shared_adapters_follow_allowed_scopes(catalog: Catalog) -> None:
    assert resolve(catalog, BASE, "acme", "chat", "k").adapter is not None
    assert resolve(catalog, BASE, "globex", "shared-all", "k").adapter is not None
    expected = "The model 'shared-chat' does not exist or you do not have access to it."
    assert error_of(catalog, "globex", "shared-chat")[1] == expected


def test_revoked_and_unreleased_versions_are_refused(catalog: Catalog) -> None:
    with pytest.raises(AdapterRevoked, match="revoked"):
        resolve(catalog, BASE, "acme", "acme-sum@2", "key")
    with pytest.raises(AdapterNotReleased, match="no released version"):
        resolve(catalog, BASE, "acme", "acme-draft", "key")
    with pytest.raises(AdapterNotReleased):
        resolve(catalog, BASE, "acme", "acme-draft@1", "key")


def test_list_models_shows_base_and_visible_released_adapters(catalog: Catalog) -> None:
    ids = [m.id for m in list_models(catalog, BASE, "acme", 0).models]
    assert ids == [BASE, "acme-sum", "shared-all", "shared-chat"]
    assert [m.id for m in list_models(catalog, BASE, "globex", 0).models] == [BASE, "globex-sql", "shared-all"]
