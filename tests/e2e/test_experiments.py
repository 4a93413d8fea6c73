"""An experiment across adapters on the real stack (the routing stack of tests/e2e/test_routing.py):
three weighted arms (a pinned adapter version, another adapter, the base model), 150 users each
served the arm the split assigns them (per-arm counts within a binomial bound of the weights, the
same user always on the same arm, a direct-NATS submission too), the status endpoint counting
exactly what was served, then a stop with a winner that serves every request, a policy's
experiment target included."""

import asyncio
import math
import time

import httpx

from shared.catalog.experiments import arm_for
from shared.catalog.rollout import split_key
from shared.schemas import Experiment
from tests.e2e.test_routing import (  # noqa: F401  # the module's stack fixture and its client
    CHAT,
    SQL,
    RoutingStack,
    _auth,
    _cli,
    _complete,
    _direct,
    _until_ready,
    client,
    routed_stack,
)

NAME = "sql-vs-chat"
USERS = [f"user-{i}" for i in range(150)]
ARMS = [
    {"name": "control", "adapter": {"adapter": SQL, "version": 1}, "weight": 5},
    {"name": "chat", "adapter": {"adapter": CHAT}, "weight": 3},
    {"name": "base", "weight": 2},
]
SERVED_BY = {"control": SQL, "chat": CHAT, "base": ""}  # the x-lorafleet-adapter header of each arm
WAIT_S = 60


async def _served(http: httpx.AsyncClient, key: str, users: list[str], body: dict) -> dict[str, str]:
    """user -> the adapter that served its request (8 at a time)."""
    limit = asyncio.Semaphore(8)

    async def one(user: str) -> tuple[str, str]:
        async with limit:
            reply = await _complete(http, key, {"user": user, "max_tokens": 1, **body})
            assert reply.status_code == 200, reply.text
            return user, reply.headers["x-lorafleet-adapter"]

    return dict(await asyncio.gather(*(one(u) for u in users)))


async def _status(http: httpx.AsyncClient, key: str, served: int) -> dict:
    """The status endpoint's answer once its figures hold ``served`` completions (the registry
    reads them from the AUDIT stream as the worker stores them)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        reply = await http.get(f"/admin/experiments/{NAME}", headers=_auth(key))
        assert reply.status_code == 200, reply.text
        status = reply.json()
        if sum(a["count"] for a in status["arms"]) >= served or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.2)


async def test_a_3_arm_experiment_splits_users_by_weight_and_ends_with_its_winner_serving_all(
    routed_stack: RoutingStack,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
):
    s = routed_stack
    await _until_ready(client, s.admin_key)
    made = await client.post("/admin/experiments", json={"name": NAME, "arms": ARMS}, headers=_auth(s.admin_key))
    assert made.status_code == 201, made.text
    experiment = Experiment.model_validate(made.json()["experiment"])
    assert (await client.post("/admin/experiments", json={"name": NAME, "arms": ARMS},
                              headers=_auth(s.admin_key))).status_code == 409  # fmt: skip

    served = await _served(client, s.admin_key, USERS, {"model": f"experiment:{NAME}"})
    expected = {u: arm_for(experiment, split_key("acme", u)).name for u in USERS}
    assert served == {u: SERVED_BY[arm] for u, arm in expected.items()}  # each user on its assigned arm
    total = sum(a["weight"] for a in ARMS)
    counts = {arm["name"]: list(expected.values()).count(arm["name"]) for arm in ARMS}
    for arm in ARMS:
        p = arm["weight"] / total
        assert abs(counts[arm["name"]] - len(USERS) * p) <= 4 * math.sqrt(len(USERS) * p * (1 - p)), counts
    again = await _served(client, s.admin_key, USERS[:30], {"model": f"experiment:{NAME}"})
    assert again == {u: served[u] for u in USERS[:30]}  # sticky: the same user, the same arm
    direct_user = USERS[0]  # a direct-NATS submission is split by the scheduler's routing step alike
    assert await _direct(s.nats.url, f"experiment:{NAME}", request_key=direct_user) == served[direct_user]

    status = await _status(client, s.admin_key, len(USERS) + 31)
    figures = {a["arm"]: a for a in status["arms"]}
    assert {arm: figures[arm]["count"] for arm in counts} == {
        arm: counts[arm] + sum(expected[u] == arm for u in [*USERS[:30], direct_user]) for arm in counts
    }  # exactly what was served: the gateway's 180 and the direct one
    control = figures["control"]
    assert control["ttft_p50_ms"]["low"] <= control["ttft_p50_ms"]["value"] <= control["ttft_p50_ms"]["high"]
    assert control["share"]["low"] < control["share"]["value"] < control["share"]["high"]
    metrics = (await client.get("/metrics")).text
    assert f'experiment_requests_total{{arm="chat",experiment="acme/{NAME}",route="http"}}' in metrics
    shown = _cli(s, "experiment", "status", "acme", NAME)
    assert shown.returncode == 0 and "control" in shown.stdout and SQL in shown.stdout, shown.stdout

    paused = await client.post(f"/admin/experiments/{NAME}/pause", json={}, headers=_auth(s.admin_key))
    assert paused.status_code == 200 and paused.json()["experiment"]["state"] == "paused"
    assert set((await _served(client, s.admin_key, USERS[:10], {"model": f"experiment:{NAME}"})).values()) == {SQL}
    assert (
        await client.post(f"/admin/experiments/{NAME}/resume", json={}, headers=_auth(s.admin_key))
    ).status_code == 200

    rule = {"name": "ab", "match": {"metadata": {"ab": "1"}}, "target": {"kind": "experiment", "experiment": NAME}}
    assert (await client.put("/admin/policies", json={"rules": [rule]}, headers=_auth(s.admin_key))).status_code == 200
    try:
        stopped = _cli(s, "experiment", "stop", "acme", NAME, "--winner", "chat")
        assert stopped.returncode == 0, stopped.stdout
        after = await _served(client, s.admin_key, USERS[:40], {"model": f"experiment:{NAME}"})
        assert set(after.values()) == {CHAT}  # the winner serves 100%
        by_rule = await _served(client, s.admin_key, USERS[40:50], {"model": SQL, "metadata": {"ab": "1"}})
        assert set(by_rule.values()) == {CHAT}  # and through the policy that names the experiment
    finally:
        await client.put("/admin/policies", json={"rules": []}, headers=_auth(s.admin_key))
    listed = await client.get("/admin/experiments", headers=_auth(s.admin_key))
    assert [(e["name"], e["state"], e["winner"]) for e in listed.json()["experiments"]] == [(NAME, "stopped", "chat")]
