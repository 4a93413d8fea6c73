"""Grammar compiles are bounded: a hostile regex ``pattern`` is killed with its child process at the
time bound and refused (400 grammar_too_complex) while another tenant's grammar compiles beside it;
each tenant waits for its own compile turns and holds its own share of the cache."""

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.worker.engine.grammar import Grammars
from shared.config import GrammarBounds
from shared.errors import GrammarCompilesBusy, GrammarTooComplex, InvalidSchema
from shared.schemas import StructuredOutput

# 18 bytes of regex: xgrammar's automaton for it takes over a minute of CPU on SmolLM2's vocabulary
HOSTILE_PATTERN = '([^"]{1,10}){1,20}'
HOSTILE = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": HOSTILE_PATTERN}},
    "required": ["code"],
}
BOUND_S = 2.0
SLACK_S = 3.0  # killing the child and starting its replacement, on a shared 2-core box


def schema(i: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"field_{i}": {"type": "integer"}}, "required": [f"field_{i}"]}


def spec(body: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput(kind="json_schema", json_schema=json.dumps(body))


@pytest.fixture(scope="module")
def tokenizer(smollm_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture
def grammars(tokenizer: PreTrainedTokenizerBase) -> Iterator[Grammars]:
    bounds = GrammarBounds(compile_timeout_s=BOUND_S, compile_processes=2, tenant_compiles=1, tenant_cache_share=3)
    grammars = Grammars(tokenizer, len(tokenizer), set(), 4, capacity=8, bounds=bounds)

    async def warm() -> None:  # both children booted: the bounds below time compiles, not interpreter starts
        await asyncio.gather(
            grammars.prepare(spec(schema(100)), "warm-1"), grammars.prepare(spec(schema(101)), "warm-2")
        )

    asyncio.run(warm())
    assert len(grammars.compile_pids()) == 2
    yield grammars
    grammars.close()


def compiles(outcome: str) -> float:
    return REGISTRY.get_sample_value("grammar_compiles_total", {"outcome": outcome}) or 0.0


async def test_a_hostile_pattern_is_refused_at_the_bound_while_a_neighbour_compiles(grammars: Grammars) -> None:
    counted = {outcome: compiles(outcome) for outcome in ("compiled", "too_complex", "refused_again")}
    children = set(grammars.compile_pids())
    started = time.monotonic()
    hostile = asyncio.create_task(grammars.prepare(spec(HOSTILE), "mallory"))
    await asyncio.sleep(0.3)  # the hostile compile holds a child now
    neighbour_started = time.monotonic()
    await grammars.prepare(spec(schema(1)), "alice")
    neighbour_s = time.monotonic() - neighbour_started
    with pytest.raises(GrammarTooComplex) as refused:
        await hostile
    elapsed = time.monotonic() - started
    assert refused.value.status == 400 and refused.value.code == "grammar_too_complex"
    assert refused.value.param == "response_format"
    assert BOUND_S <= elapsed < BOUND_S + SLACK_S
    assert neighbour_s < BOUND_S
    assert grammars.cached(spec(schema(1)), "alice") is not None
    # the hostile compile's child was killed and replaced: still two children, one of them new
    replaced = set(grammars.compile_pids())
    assert len(replaced) == 2 and len(children - replaced) == 1
    (killed,) = children - replaced
    with pytest.raises(ProcessLookupError):
        os.kill(killed, 0)
    # the tenant's retry is refused at once, from its cache, without another compile
    again = time.monotonic()
    with pytest.raises(GrammarTooComplex):
        await grammars.prepare(spec(HOSTILE), "mallory")
    assert time.monotonic() - again < 0.5
    # and the replacement compiles the next grammar
    grammars.compile(spec(schema(2)), "alice")
    assert compiles("compiled") == counted["compiled"] + 2
    assert compiles("too_complex") == counted["too_complex"] + 1
    assert compiles("refused_again") == counted["refused_again"] + 1


async def test_a_tenant_past_its_compile_turn_for_the_whole_bound_is_a_429_others_are_served(
    grammars: Grammars,
) -> None:
    busy = compiles("busy")
    mallory = asyncio.gather(
        grammars.prepare(spec(HOSTILE), "mallory"),
        grammars.prepare(spec(schema(3)), "mallory"),  # waits for mallory's one turn, which the regex holds
        return_exceptions=True,
    )
    await asyncio.sleep(0.3)
    neighbour_started = time.monotonic()
    await grammars.prepare(spec(schema(3)), "alice")  # alice's turn is her own, and a child is free
    assert time.monotonic() - neighbour_started < BOUND_S
    assert not mallory.done()
    hostile, waiting = await mallory
    assert isinstance(hostile, GrammarTooComplex)
    assert isinstance(waiting, GrammarCompilesBusy)
    assert waiting.status == 429 and waiting.code == "grammar_compiles_busy" and waiting.retry_after_s == BOUND_S
    assert compiles("busy") == busy + 1
    assert grammars.cached(spec(schema(3)), "mallory") is None  # a busy refusal is not remembered
    grammars.compile(spec(schema(3)), "mallory")


def test_a_tenants_grammars_are_never_served_to_or_evicted_by_another(grammars: Grammars) -> None:
    alice = grammars.compile(spec(schema(0)), "alice")
    assert grammars.compile(spec(schema(0)), "alice") is alice
    bob = grammars.compile(spec(schema(0)), "bob")
    assert bob is not alice  # compiled again for bob: no tenant learns what another compiled
    for i in range(1, 6):  # alice past her share (3): only her own oldest go
        grammars.compile(spec(schema(i)), "alice")
    assert grammars.cached(spec(schema(0)), "bob") is bob
    assert grammars.cached(spec(schema(0)), "alice") is None
    assert grammars.cached(spec(schema(5)), "alice") is not None
    for i in range(6, 9):  # the cache (8) full: the largest holders give up their oldest, not bob his one
        grammars.compile(spec(schema(i)), "carol")
        grammars.compile(spec(schema(i)), "dave")
    assert grammars.cached(spec(schema(0)), "bob") is bob


def test_a_schema_xgrammar_refuses_is_still_invalid_json_schema(grammars: Grammars) -> None:
    bad = spec({"type": "string", "pattern": "(?<=a)b"})
    with pytest.raises(InvalidSchema) as refused:
        grammars.compile(bad, "alice")
    assert refused.value.code == "invalid_json_schema" and "cannot be enforced" in refused.value.message


async def test_a_tenant_that_hangs_up_keeps_its_turn_until_its_compile_ends(grammars: Grammars) -> None:
    hung_up = asyncio.create_task(grammars.prepare(spec(HOSTILE), "mallory"))
    await asyncio.sleep(0.1)
    hung_up.cancel()  # the client went away; the compile in the child runs on to the bound
    with pytest.raises(asyncio.CancelledError):
        await hung_up
    started = time.monotonic()
    with pytest.raises(GrammarTooComplex):  # its next compile starts only once the first one's child is killed
        await grammars.prepare(spec({**HOSTILE, "title": "again"}), "mallory")
    assert time.monotonic() - started >= 2 * BOUND_S - 0.6
    await grammars.prepare(spec(schema(4)), "alice")


def test_a_compile_child_exits_when_its_worker_dies_mid_compile(tmp_path: Path, smollm_dir: Path) -> None:
    """The worker is killed while its child compiles the hostile pattern: the child exits within
    seconds instead of running the minute-long compile to its end."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import json, sys, time\n"
        "from transformers import AutoTokenizer\n"
        "from services.worker.engine.grammar import Grammars\n"
        "from shared.schemas import StructuredOutput\n"
        "if __name__ == '__main__':\n"
        f"    tokenizer = AutoTokenizer.from_pretrained({str(smollm_dir)!r})\n"
        "    grammars = Grammars(tokenizer, len(tokenizer), set(), 1, 8)\n"
        "    grammars.compile(StructuredOutput(kind='json_object'))\n"
        "    print(*grammars.compile_pids(), flush=True)\n"
        f"    grammars.compile(StructuredOutput(kind='json_schema', json_schema=json.dumps({HOSTILE!r})))\n"
    )
    worker = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    assert worker.stdout is not None
    children = [int(pid) for pid in worker.stdout.readline().split()]
    assert len(children) == 2
    time.sleep(1.0)  # one child is inside the hostile compile now
    worker.kill()
    worker.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children):
        assert time.monotonic() < deadline, "a compile child outlived its worker"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie has exited; init reaps it
    except FileNotFoundError:
        return False
