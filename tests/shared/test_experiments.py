"""Experiments across adapters: the one weighted split (``assign``), the canary split as its 2-arm
case, and ``experiment:<name>`` / a policy's experiment target routed to an arm, sticky by
(tenant, user), through the scheduler's grant as well."""

import hashlib
import math

import pytest

from shared.catalog.experiments import BUCKETS, arm_for, assign, experiment_key
from shared.catalog.grants import Grants
from shared.catalog.policy import RequestFacts
from shared.catalog.resolve import to_resolved
from shared.catalog.rollout import in_canary, split_key
from shared.catalog.routing import Routes
from shared.errors import ModelNotFound
from shared.schemas import Experiment
from tests.scheduler.test_grants import BASE, PROD, SHARED_V1, submission
from tests.shared.test_routing import routes, routing_view, rule

KEYS = [f"user-{i}" for i in range(3000)]


def experiment(state: str = "running", winner: str | None = None, name: str = "sum-vs-chat") -> Experiment:
    return Experiment.model_validate(
        {
            "tenant_id": "acme",
            "name": name,
            "state": state,
            "winner": winner,
            "arms": [
                {"name": "control", "adapter": {"adapter": "sum", "version": 1}, "weight": 5},
                {"name": "chat", "adapter": {"adapter": "shared-chat"}, "weight": 3},
                {"name": "base", "weight": 2},
            ],
        }
    )


def with_experiment(state: Routes, exp: Experiment) -> Routes:
    state.apply(experiment_key(exp.tenant_id, exp.name), exp.model_dump_json().encode(), 9)
    return state


def within_binomial(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_assignment_is_sticky_and_follows_the_weights_within_a_binomial_bound():
    weights = [5, 3, 2]
    first = [assign(weights, "exp", k) for k in KEYS]
    assert first == [assign(weights, "exp", k) for k in KEYS]  # the same key, the same arm
    for index, weight in enumerate(weights):
        assert within_binomial(first.count(index), len(KEYS), weight / sum(weights)), (index, first.count(index))
    other = [assign(weights, "another-exp", k) for k in KEYS]
    assert other != first  # independent per salt
    assert {assign([0, 1, 0], "exp", k) for k in KEYS} == {1}  # a weight-0 arm gets no key
    with pytest.raises(ValueError):
        assign([0, 0], "exp", "k")


def test_the_canary_split_is_the_2_arm_case_unchanged():
    """The split before it was one code path: ``sha256(adapter \\0 key)`` bucket < round(percent * 100)."""

    def before(adapter_id: str, key: str, percent: float) -> bool:
        digest = hashlib.sha256(f"{adapter_id}\x00{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") % BUCKETS < round(percent * BUCKETS / 100)

    for percent in (0.01, 0.1, 1.0, 5.0, 10.0, 33.33, 50.0, 99.99, 100.0):
        for key in KEYS[:1000]:
            assert in_canary("acme-sum", key, percent) == before("acme-sum", key, percent), (percent, key)


def test_an_experiment_routes_each_user_to_its_arm_pauses_to_control_and_stops_to_its_winner():
    state = with_experiment(routes(), experiment())
    served = {
        k: state.route("acme", "experiment:sum-vs-chat", None, RequestFacts(request_key=k), base_model=BASE)
        for k in KEYS[:600]
    }
    models = {"control": "sum@1", "chat": "shared-chat", "base": BASE}
    for key, routed in served.items():
        assert routed.experiment == "sum-vs-chat" and routed.model == models[routed.arm or ""]
        assert routed.arm == arm_for(experiment(), split_key("acme", key)).name
    assert {r.arm for r in served.values()} == set(models)
    with_experiment(state, experiment("paused"))
    assert {state.route("acme", "experiment:sum-vs-chat", None, RequestFacts(request_key=k)).arm for k in KEYS[:50]} \
        == {"control"}  # fmt: skip
    with_experiment(state, experiment("stopped", winner="chat"))
    assert {state.route("acme", "experiment:sum-vs-chat", None, RequestFacts(request_key=k)).model for k in KEYS[:50]} \
        == {"shared-chat"}  # fmt: skip
    with pytest.raises(ModelNotFound):  # another tenant's experiment of that name is not there for it
        state.route("other", "experiment:sum-vs-chat", None, RequestFacts(request_key="u"))


def test_the_split_is_by_tenant_and_user_not_by_the_user_alone():
    """The same ``user`` string under two tenants is two split keys (a client's chosen key never
    decides another tenant's arm): the arms of 3000 users agree across tenants only by chance."""
    exp = experiment()
    acme = [arm_for(exp, split_key("acme", k)).name for k in KEYS]
    other = [arm_for(exp, split_key("other", k)).name for k in KEYS]
    agree = sum(a == b for a, b in zip(acme, other, strict=True)) / len(KEYS)
    assert agree < 0.5  # independent: 0.5^2 + 0.3^2 + 0.2^2 = 0.38 expected


async def test_a_policy_experiment_target_is_granted_by_the_scheduler_with_its_arm():
    state = with_experiment(
        routes(rules=[rule("ab", {"kind": "experiment", "experiment": "sum-vs-chat"}, metadata={"team": "bi"})]),
        experiment(),
    )
    view = routing_view(state)
    grants = Grants(view.resolve, view.catalog, view.route)
    arms = {}
    for key in KEYS[:40]:
        granted = await grants.grant(submission("sum", request_key=key, metadata={"team": "bi"}), preview=False)
        assert granted.experiment == "sum-vs-chat" and granted.arm is not None
        arms[granted.arm] = granted
    assert set(arms) == {"control", "chat", "base"}
    assert arms["control"].adapter == to_resolved(PROD) and arms["chat"].adapter == to_resolved(SHARED_V1)
    assert arms["base"].adapter is None and arms["base"].model == BASE
    plain = await grants.grant(submission("sum", request_key="u1"), preview=False)  # no rule: no experiment
    assert plain.experiment is None and plain.adapter == to_resolved(PROD)
