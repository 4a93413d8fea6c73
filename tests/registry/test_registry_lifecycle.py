"""Lifecycle steps, the deterministic rollout split, and rollback as seen by the next resolve."""

from collections.abc import Callable

import pytest

from services.registry import lifecycle
from shared.catalog.records import Catalog
from shared.catalog.resolve import resolve
from shared.catalog.rollout import BUCKETS, bucket, in_canary
from shared.errors import Conflict
from shared.schemas import AdapterRecord

KEYS = [f"req-{i}" for i in range(BUCKETS)]


def served_version(catalog: Catalog, key: str) -> int:
    reply = resolve(catalog, "tiny-llama", "acme", "summarize", key)
    assert reply.adapter is not None
    return reply.adapter.version


@pytest.fixture
def catalog(make_record: Callable[..., AdapterRecord]) -> Catalog:
    return Catalog([make_record(version=1), make_record(version=2)])


def step(catalog: Catalog, changes: list) -> list[tuple[int, str, float]]:
    catalog.apply(changes)
    return [(c.after.version, c.after.status, c.after.traffic_percent) for c in changes]


def test_staged_rollout_to_production(catalog: Catalog) -> None:
    assert step(catalog, lifecycle.promote(catalog, "summarize", 1, 100)) == [(1, "production", 100.0)]
    assert step(catalog, lifecycle.promote(catalog, "summarize", 2, 1)) == [(2, "canary", 1.0)]
    for percent in (10, 50):
        assert step(catalog, lifecycle.rollout(catalog, "summarize", percent)) == [(2, "canary", float(percent))]
    final = step(catalog, lifecycle.rollout(catalog, "summarize", 100))
    assert final == [(1, "retired", 0.0), (2, "production", 100.0)]


def test_rollout_split_matches_percent_and_is_stable(catalog: Catalog) -> None:
    catalog.apply(lifecycle.promote(catalog, "summarize", 1, 100))
    catalog.apply(lifecycle.promote(catalog, "summarize", 2, 1))
    for percent in (1, 10, 50):
        catalog.apply(lifecycle.rollout(catalog, "summarize", percent))
        served = [served_version(catalog, k) for k in KEYS]
        share = 100 * served.count(2) / len(KEYS)
        assert abs(share - percent) <= 2, (percent, share)
        assert served == [served_version(catalog, k) for k in KEYS]  # same key -> same version


def test_canary_keys_stay_in_canary_as_the_share_grows() -> None:
    at_10 = {k for k in KEYS if in_canary("summarize", k, 10)}
    at_50 = {k for k in KEYS if in_canary("summarize", k, 50)}
    assert at_10 < at_50
    assert at_10 != {k for k in KEYS if in_canary("other", k, 10)}  # each adapter splits independently
    assert all(0 <= bucket("summarize", k) < BUCKETS for k in KEYS)


def test_rollback_of_a_canary_takes_effect_on_the_next_resolve(catalog: Catalog) -> None:
    catalog.apply(lifecycle.promote(catalog, "summarize", 1, 100))
    catalog.apply(lifecycle.promote(catalog, "summarize", 2, 50))
    assert {served_version(catalog, k) for k in KEYS[:200]} == {1, 2}
    assert step(catalog, lifecycle.rollback(catalog, "summarize")) == [(2, "staging", 0.0)]
    assert {served_version(catalog, k) for k in KEYS[:200]} == {1}


def test_rollback_of_production_restores_the_previous_production(catalog: Catalog) -> None:
    catalog.apply(lifecycle.promote(catalog, "summarize", 1, 100))
    catalog.apply(lifecycle.promote(catalog, "summarize", 2, 100))
    assert served_version(catalog, "k") == 2
    assert step(catalog, lifecycle.rollback(catalog, "summarize")) == [(2, "retired", 0.0), (1, "production", 100.0)]
    assert served_version(catalog, "k") == 1


def test_refused_transitions(catalog: Catalog) -> None:
    with pytest.raises(Conflict, match="no canary version to roll out"):
        lifecycle.rollout(catalog, "summarize", 10)
    with pytest.raises(Conflict, match="no released version to roll back"):
        lifecycle.rollback(catalog, "summarize")
    catalog.apply(lifecycle.promote(catalog, "summarize", 1, 100))
    with pytest.raises(Conflict, match="no previous production version"):
        lifecycle.rollback(catalog, "summarize")
    with pytest.raises(Conflict, match="only a staging version can be promoted"):
        lifecycle.promote(catalog, "summarize", 1, 10)
    catalog.apply(lifecycle.promote(catalog, "summarize", 2, 10))
    catalog.apply(lifecycle.revoke(catalog, "summarize", None))
    assert {r.status for r in catalog.versions("summarize")} == {"revoked"}
    with pytest.raises(Conflict, match="already revoked"):
        lifecycle.revoke(catalog, "summarize", None)
    with pytest.raises(Conflict, match="already revoked"):
        lifecycle.retire(catalog, "summarize", 1)
