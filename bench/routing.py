"""What routing adds to a request's resolution: the policy rules and the task table walked before
the normal resolve, against today's plain resolve, in one run on one catalog.

``python -m bench.routing [--quick]``: a catalog of 200 released adapters of one tenant (as every
gateway and scheduler view holds it), 20 policy rules (10 platform-wide, 10 the tenant's, each
matching on a key id, metadata or a header), and a task table. Each peer is timed per call with
``perf_counter_ns`` in a tight loop:

- ``resolve``: ``resolve()`` of an adapter name (what every request costs today);
- ``route+resolve, no state``: a tenant with no routes or rules (the fast path);
- ``route+resolve, task, 20 rules miss``: ``task:<name>`` after all 20 rules fail to match;
- ``route+resolve, 20th rule matches``: the last rule (by key id) picks the adapter;
- ``route+resolve, experiment, 20 rules miss``: ``experiment:<name>`` (3 weighted arms, the
  request key hashed to its arm) after all 20 rules fail to match;
- ``evaluator, 20 rules miss``: ``first_match`` alone over both sets.

Writes bench/results/routing.json and a Markdown table (p50 / p99 in microseconds, and each peer's
p50 over the plain resolve's).
"""

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

from bench.cache_sim import git_commit
from shared.catalog.experiments import experiment_key
from shared.catalog.policy import RequestFacts, first_match
from shared.catalog.records import Catalog
from shared.catalog.resolve import resolve
from shared.catalog.routing import Routes, policies_key, tasks_key
from shared.schemas import AdapterRecord, Experiment, PolicyRule, RoutePolicies, TaskRoutes

RESULTS = Path(__file__).parent / "results"
BASE = "tiny-llama"
TENANT = "acme"
ADAPTERS = 200
HIT_KEY = "00000000000000ff"
DIGEST = "0" * 64


def record(i: int) -> AdapterRecord:
    return AdapterRecord(
        adapter_id=f"adapter-{i}", version=1, tenant_id=TENANT, base_model=BASE, base_model_fingerprint=DIGEST,
        task_type="chat", rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"],
        files={"adapter_model.safetensors": DIGEST, "adapter_config.json": DIGEST}, digest=DIGEST,
        manifest_digest=DIGEST, storage_uri=f"nats-os://lf_adapter_store/adapter-{i}/1", status="production",
        traffic_percent=100,
    )  # fmt: skip


def rules(prefix: str, n: int, last_hits: bool) -> list[PolicyRule]:
    """``n`` rules matching nothing the timed requests carry (key ids, metadata, headers in turn);
    with ``last_hits`` the last matches ``HIT_KEY``."""
    out = []
    for i in range(n):
        kinds = (
            {"key_id": f"{i:016x}"},
            {"metadata": {"team": f"t{i}"}},
            {"header": {"name": "x-app", "value": f"a{i}"}},
        )
        match = {"key_id": HIT_KEY} if last_hits and i == n - 1 else kinds[i % 3]
        target = {"kind": "adapter", "adapter": {"adapter": f"adapter-{i}"}}
        out.append(PolicyRule.model_validate({"name": f"{prefix}{i}", "match": match, "target": target}))
    return out


def state() -> Routes:
    routes = Routes()
    table = TaskRoutes(tenant_id=TENANT, routes={f"task{i}": {"adapter": f"adapter-{i}"} for i in range(20)})
    routes.apply(tasks_key(TENANT), table.model_dump_json().encode(), 1)
    routes.apply(policies_key(None), RoutePolicies(rules=rules("p", 10, False)).model_dump_json().encode(), 2)
    tenant = RoutePolicies(tenant_id=TENANT, rules=rules("t", 10, True))
    routes.apply(policies_key(TENANT), tenant.model_dump_json().encode(), 3)
    arms = [{"name": f"arm{i}", "adapter": {"adapter": f"adapter-{i}"}, "weight": w} for i, w in enumerate((5, 3, 2))]
    experiment = Experiment.model_validate({"tenant_id": TENANT, "name": "ab", "arms": arms})
    routes.apply(experiment_key(TENANT, "ab"), experiment.model_dump_json().encode(), 4)
    return routes


def timed(call: Callable[[], object], n: int) -> dict[str, float]:
    for _ in range(min(n, 2000)):  # warm-up
        call()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        start = clock()
        call()
        samples.append(clock() - start)
    samples.sort()
    return {"p50_us": samples[n // 2] / 1000, "p99_us": samples[int(n * 0.99)] / 1000, "n": n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20,000 calls per peer (seconds)")
    args = parser.parse_args()
    n = 20_000 if args.quick else 200_000
    catalog = Catalog(record(i) for i in range(ADAPTERS))
    routes, empty = state(), Routes()
    miss = RequestFacts(tier="standard", key_id="0123456789abcdef", model="task:task7", metadata={"team": "x"},
                        headers={"x-app": "none"})  # fmt: skip
    hit = RequestFacts(tier="standard", key_id=HIT_KEY, model="adapter-3")
    all_rules = [*routes.platform.rules, *routes.tenant_policies(TENANT).rules]

    keyed = RequestFacts(tier="standard", key_id="0123456789abcdef", model="experiment:ab", metadata={"team": "x"},
                         headers={"x-app": "none"}, request_key="user-1")  # fmt: skip

    def routed(table: Routes, model: str, facts: RequestFacts) -> Callable[[], object]:
        def call() -> object:
            chosen = table.route(TENANT, model, None, facts, base_model=BASE)
            return resolve(catalog, BASE, TENANT, chosen.model, "user-1")

        return call

    peers = {
        "resolve": timed(lambda: resolve(catalog, BASE, TENANT, "adapter-7", "user-1"), n),
        "route+resolve, no state": timed(routed(empty, "adapter-7", miss), n),
        "route+resolve, task, 20 rules miss": timed(routed(routes, "task:task7", miss), n),
        "route+resolve, 20th rule matches": timed(routed(routes, "adapter-3", hit), n),
        "route+resolve, experiment, 20 rules miss": timed(routed(routes, "experiment:ab", keyed), n),
        "evaluator, 20 rules miss": timed(lambda: first_match(all_rules, miss), n),
    }
    base = peers["resolve"]["p50_us"]
    for figures in peers.values():
        figures["p50_over_resolve"] = figures["p50_us"] / base
    result = {
        "peers": peers,
        "adapters": ADAPTERS,
        "rules": len(all_rules),
        "environment": {"python": platform.python_version(), "machine": platform.machine(), "git_commit": git_commit()},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "routing.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (RESULTS / "routing.md").write_text(table + "\n")
    print(table)


def markdown(result: dict) -> str:
    rows = ["| peer | p50 (us) | p99 (us) | p50 / resolve |", "|---|---|---|---|"]
    for name, r in result["peers"].items():
        rows.append(f"| {name} | {r['p50_us']:.2f} | {r['p99_us']:.2f} | {r['p50_over_resolve']:.2f}x |")
    rows.append(
        f"\n{result['rules']} rules, {result['adapters']} adapters, {next(iter(result['peers'].values()))['n']} calls per peer"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
