"""Fixtures: real nats-server and redis-server processes on free ports, the base model cache."""

import atexit
import inspect
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from lorafleet.cli import infra
from lorafleet.cli.infra import Server, start_nats, start_redis
from tests.helpers.ports import PortSlice, own_slice

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("LF_MODEL_CACHE", str(REPO / ".lorafleet" / "models"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The registry refuses to promote a version with no recorded eval by default (issue 47); the test
# stacks promote random adapters that have no eval set, so they run with that check off (and /readyz
# says so). tests/registry/test_gate.py holds the default; the release controller tests pass their own policy.
os.environ.setdefault("LF_RELEASE_REQUIRE_EVAL", "false")
# base-model fingerprints are cached per directory: a session-private cache, never the user's, removed by
# the process that made it (pytest-xdist's workers inherit the controller's)
if "LF_FINGERPRINT_CACHE" not in os.environ:
    os.environ["LF_FINGERPRINT_CACHE"] = tempfile.mkdtemp(prefix="lf-fingerprints-")
    atexit.register(shutil.rmtree, os.environ["LF_FINGERPRINT_CACHE"], ignore_errors=True)
# A pytest started as a background job of a non-interactive shell (`make test`'s background tier) inherits
# SIGINT ignored: restore Python's handler, so that Ctrl-C or the Makefile's trap interrupts it as it would a
# pytest in the foreground, and its fixtures stop the processes they started.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Triton picks interpreter or compiler when a kernel is decorated, i.e. at the first import of
# kernels/, which any test module may trigger: choose the CPU interpreter before all of them.
os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs the light tiers under pytest-xdist (`-n 2`): WORKER is set in each worker process.
# Every worker hands out ports from a slice of its own (tests/helpers/ports.py), installed here before
# any test module imports free_port; and each runs torch on one thread (the workers share the cores;
# a test that measures threads sets its own count, tests/kernels/test_native_lora.py).
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
OWN_PORTS = own_slice()
if OWN_PORTS is not None:
    infra.free_port = PortSlice(OWN_PORTS).free_port
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The embedded SmolLM2 as a safetensors directory (converted from its GGUF on first use)."""
    from shared.base_model import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_nats(infra.free_port(), tmp_path_factory.mktemp("nats"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: Server) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_redis(infra.free_port(), tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: Server) -> str:
    return redis_server.url


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[Server]:
    """A nats-server of this test alone, for tests that restart or fill it."""
    server = start_nats(infra.free_port(), tmp_path / "nats")
    yield server
    server.stop()


# Test tiers: `make test-fast` runs `-m "not servers and not model and not slow"`, the tests that need
# no process besides pytest and no embedded model. A test is marked from the fixtures it uses
# (``item.fixturenames`` is their transitive closure) or, when it starts a process itself, from
# PROCESS_TESTS. A fixture is named alone (any definition of that name) or as "file::name" (that
# definition only). Under LF_TEST_TIER=fast (`make test-fast`) a test that starts a process or reads
# the model cache fails, so one missing from these lists cannot slip into the fast tier.
SERVER_FIXTURES = frozenset(
    {
        "nats_server",  # nats_url
        "redis_server",  # redis_url
        "own_nats",
        "gw_nats",  # tests/gateway: the gateway fixture's registry
        "auth_server",  # tests/deploy: nats-server with the generated permissions
        "secured",  # tests/deploy/test_direct_nats.py: the stack under the permission model
        "fleet",  # tests/scheduler, tests/faults: the stack's processes
        "hostile",  # tests/hostile
        "running_stack",  # tests/e2e
        "docker_host",  # tests/compose: dockerd and the compose projects
        "engine_stack",  # tests/e2e/test_engines.py: the stack on each worker engine
        "routed_stack",  # tests/e2e/test_routing.py: the stack with task routes and policies
        "pair",  # tests/scheduler/test_engine_placement.py: two workers of unlike engines
        "tests/deploy/test_redis_auth.py::redis_port",  # a redis-server with a password
        "tests/shared/test_redis_sentinel.py::replicated",  # a Redis master, a replica and three sentinels
        "tests/scheduler/test_dedupe_outage.py::restartable_redis",  # a redis-server it stops and starts
    }
)
MODEL_FIXTURES = frozenset(
    {
        "smollm_dir",
        "tests/worker/engine/test_engine.py::loaded",  # load_model(): the embedded SmolLM2
        "tests/worker/engine/test_prefix_cache.py::loaded",
        "tests/worker/test_serving_cache.py::loaded",
        "tests/worker/test_serving_slo.py::loaded",
        "tests/worker/engine/test_engine_grammar.py::loaded",
        "tests/worker/engine/test_engine_sampling.py::loaded",
        "tests/worker/engine/test_engine_tools.py::loaded",
        "tests/worker/engine/test_engine_prompt_logprobs.py::loaded",
        "tests/worker/engine/test_async_engine.py::parts",
        "tests/worker/engine/test_sampler.py::tokenizer",
        "tests/worker/engine/test_multilora_engine.py::setup",  # its tokenizer, in both parameters
        "tests/worker/engine/test_step_cost.py::loaded",
        "tests/worker/test_serving_cost.py::loaded",
        "tests/worker/test_serving_shadow.py::loaded",
    }
)
PROCESS_TESTS: dict[str, str] = {  # node id (a test, any of its parameters, or a whole file) -> what it starts
    "tests/bench/test_hop_floor.py": "the bare pipeline's processes",
    "tests/worker/engine/test_grammar_pool.py": "xgrammar's compile child processes (services/worker/grammar_pool.py)",
    "tests/worker/engine/test_engine_grammar.py": "xgrammar's compile child processes",
    "tests/worker/engine/test_engine_tools.py": "xgrammar's compile child processes",
    "tests/worker/vllm_engine/test_vllm_engine.py": "vLLM's engine in .venv-vllm's interpreter",
    "tests/worker/vllm_engine/test_vllm_bases.py": "vLLM's engine in .venv-vllm's interpreter",
    "tests/bench/test_load.py::test_a_short_run_on_the_tiny_model_completes_every_request": "the load stack",
    "tests/e2e/test_up_own_model.py": "lorafleet up and its whole stack",
    "tests/cli/test_nats_limits.py": "nats-server",
    "tests/cli/test_up_redis.py": "redis-server and its sentinels",
    "tests/cli/test_wheel_install.py": "pip, a fresh environment and the installed services and command",
    "tests/kernels/test_kernel_cache.py": "python processes that build or load the native kernels, lorafleet kernels",
    "tests/kernels/test_omp_threads.py": "a python process (torch's intra-op counts are process-wide)",
    "tests/worker/engine/test_step_thread.py": "a python process (torch's intra-op counts are process-wide)",
    "tests/deploy/test_compose.py::test_generated_nats_config_is_accepted_by_nats_server": "nats-server -t",
    "tests/deploy/test_compose.py::test_every_file_init_writes_is_ignored_by_git": "git check-ignore",
    "tests/deploy/test_compose_init.py": "compose's init command, git ls-files and nats-server -t",
    "tests/deploy/test_compose_cluster.py": "compose's init command and nats-server -t",
    "tests/deploy/test_k8s.py": "create-secrets.sh's init command, nats-server -t and kubectl kustomize",
    "tests/deploy/test_direct_nats.py::test_the_readme_shows_exactly_what_user_create_prints": "the CLI",
    "tests/hostile/test_config_hostile.py::test_service_with_a_bad_config_exits_with_one_line": "a service",
    "tests/shared/test_env_names.py::test_a_service_with_an_unknown_variable_exits_with_one_line": "a service",
    "tests/shared/test_env_names.py::test_lorafleet_up_refuses_an_unknown_variable_before_starting_anything": "lorafleet up",
    "tests/bench/test_gpu_check.py": "bash and bench/gpu_check.sh",
    "tests/bench/test_peers_stack.py::test_a_peer_that_exits_while_starting_is_unavailable_with_its_log": "a python process",
    "tests/bench/test_peers_stack.py::test_the_load_table_of_a_short_run_with_a_missing_peer": "the stack, tiny model",
    "tests/bench/test_placement_scale.py::test_the_command_writes_json_and_markdown": "python -m bench.placement_scale",
    "tests/cli/test_supervisor.py": "the supervised python processes",
    "tests/cli/test_stack_kill.py::test_a_killed_process_is_gone_and_forgotten": "a python process",
    "tests/deploy/test_compose_hardening.py": "compose's init command",
    "tests/deploy/test_k8s_hardening.py": "create-secrets.sh's init command and nats-server",
    "tests/deploy/test_nats_accounts.py::test_a_local_store_from_before_accounts_moves_to_the_platform_account": "nats-server",
    "tests/faults/test_nats_cluster.py": "a 3-node NATS cluster and the stack",
    "tests/scheduler/test_rank_pools_stack.py": "the stack with two workers",
}
# `make test` runs these in its second, serial pytest (with the vllm and compose tiers), not beside
# another xdist worker (only the niced background tier below): they time a kill under load, measure, or
# load every core themselves.
SERIAL_TESTS: dict[str, str] = {  # node id -> why
    "tests/faults": "kills a process under load and times the recovery",
    "tests/bench/test_load.py::test_a_short_run_on_the_tiny_model_completes_every_request": "a load run",
    "tests/bench/test_peers_stack.py::test_the_load_table_of_a_short_run_with_a_missing_peer": "a load run",
    "tests/bench/test_hop_floor.py": "measures the bare pipeline's latency floor",
    "tests/e2e/test_up_own_model.py": "kill -9 of every process of a whole stack under traffic",
    "tests/registry/test_release_live.py::test_a_killed_registry_is_replaced_and_the_rollout_carries_on": "kills the "
    "registry mid-rollout (under -n 2 on a loaded runner it ran past its 300 s timeout once)",
}
# `make test` runs these niced in a third pytest beside its serial one: heavy on the CPU, but neither timed nor
# bound to a liveness deadline (a program's result, not a stack's), so they take the cores the serial tier's
# fault tests leave idle while those wait on kills and recoveries. Not beside the light tiers: their memory
# and these (two vLLM engines and four HF models at once) would not fit in 23 GiB together.
BACKGROUND_TESTS: dict[str, str] = {  # node id -> why
    "tests/worker/vllm_engine/test_vllm_engine.py": "two vLLM programs and HF PEFT's reference, results compared",
    "tests/worker/vllm_engine/test_vllm_bases.py": "one vLLM program, results compared",
    "tests/bench/test_engine_peers.py": "both engines' benchmark on a tiny model: its report's shape, not its figures",
}
MODEL_TESTS: tuple[str, ...] = (  # the embedded SmolLM2 without one of the fixtures above
    "tests/shared/test_fingerprint.py::test_embedded_smollm2_fingerprint_is_stable",
    "tests/worker/engine/test_engine_model.py::test_smollm2_matches_transformers",
    "tests/worker/test_serving_isolation.py",
    "tests/scheduler/test_rank_pools_stack.py",
    "tests/faults/test_nats_cluster.py",
    "tests/bench/test_quant_evals.py::test_a_short_run_scores_each_answer_with_its_items_scorer_and_reports_a_refused_format",
)


def _listed(nodeid: str, prefixes: Iterable[str]) -> bool:
    """Whether ``nodeid`` is one of ``prefixes``: a folder, a file, a test or one of its parameters."""
    return any(nodeid == p or nodeid.startswith(p + _separator(p)) for p in prefixes)


def _separator(prefix: str) -> str:
    if prefix.endswith(".py"):
        return "::"
    return "[" if "::" in prefix else "/"


def _fixtures(item: pytest.Item) -> set[str]:
    """Every fixture the test uses, as "name" and as "file::name" of the definition in force."""
    found = set(getattr(item, "fixturenames", ()))
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in list(found):
        for fixturedef in definitions.get(name, ())[-1:]:
            path = Path(inspect.getfile(fixturedef.func)).resolve()
            if path.is_relative_to(REPO):
                found.add(f"{path.relative_to(REPO).as_posix()}::{name}")
    return found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = _fixtures(item)
        if fixtures & SERVER_FIXTURES or _listed(item.nodeid, PROCESS_TESTS):
            item.add_marker(pytest.mark.servers)
        if fixtures & MODEL_FIXTURES or _listed(item.nodeid, MODEL_TESTS):
            item.add_marker(pytest.mark.model)
        if _listed(item.nodeid, SERIAL_TESTS):
            item.add_marker(pytest.mark.serial)
        if _listed(item.nodeid, BACKGROUND_TESTS):
            item.add_marker(pytest.mark.background)
    # the fault tests first (a stable sort: every other test keeps its place): they wait on kills and
    # recoveries, two thirds of the time with idle cores, which `make test`'s background tier takes
    items.sort(key=lambda item: not _listed(item.nodeid, ("tests/faults",)))


_running: list[str] = []  # the node id of the test under way, under LF_TEST_TIER=fast


def _fast_tier_guard(event: str, args: tuple) -> None:
    if not _running:
        return
    if event in ("subprocess.Popen", "os.posix_spawn", "os.system", "os.exec", "os.spawn"):
        what = f"starts a process ({event} {str(args[:2])[:120]})"
    elif event == "open" and isinstance(args[0], str) and args[0].startswith(os.environ["LF_MODEL_CACHE"]):
        what = f"reads the model cache ({args[0]})"
    else:
        return
    raise RuntimeError(f"{_running[0]} {what}: not a fast-tier test; list it in tests/conftest.py")


if os.environ.get("LF_TEST_TIER") == "fast":
    sys.addaudithook(_fast_tier_guard)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build (or load) the native CPU kernels once, before any test: on a fresh machine their g++ build
    takes about a minute, which belongs to no test's timeout, and runs outside the fast tier's process
    guard; every engine and adapter manager built afterwards finds them loaded and probed
    (kernels.native.native_decode, native_lora)."""
    from kernels.native import native_decode, native_lora

    native_decode()
    native_lora()
    if WORKER:
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> object:
    """Setup, call and teardown of one test (module and session fixtures are set up in its setup)."""
    _running[:] = [item.nodeid] if os.environ.get("LF_TEST_TIER") == "fast" else []
    try:
        return (yield)
    finally:
        _running.clear()
