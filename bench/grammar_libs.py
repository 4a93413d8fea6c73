"""Grammar libraries side by side on SmolLM2's tokenizer: xgrammar, llguidance and outlines-core.

``python -m bench.grammar_libs [--quick] [--reps N]``: the 32 JSON schemas of bench.structured,
compiled to compact JSON (``", "`` and ``": "`` separators, no other whitespace, as the engine
compiles them). Each repetition runs every library in turn, in a rotating order: tokenizer-info
setup; each schema compiled cold (a fresh compiler, the library's own cache off) and cached (the
engine's way: sha256 digest -> a dict of compiled grammars, plus a fresh matcher from it); then 32
matchers, one per schema, each walk a realistic token path (a valid instance of its schema,
tokenized, then EOS) and every step fills the bitmasks of all 32 rows: row by row as the engine
does, right after compile (cold) and again (warm), then through the library's parallel batch API
where it has one. outlines-core, whose Index takes seconds per schema to build, runs in the
first repetition alone. Only steps where all 32 rows are still on their path are timed. Every path token
must be allowed by its row's mask: schemas that fail to compile and valid instances a mask
rejects are counted. The bitmask layout is the same for all three (int32, bit ``t % 32`` of word
``t // 32``), so applying it to the logits is measured once, with xgrammar's CPU kernel.

llguidance and outlines-core are not runtime dependencies: ``pip install -e '.[bench]'``.
"""

import argparse
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import jsonschema
import torch
import xgrammar as xgr
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from bench.environment import environment, load_average
from bench.load.stack import base_model_dir
from bench.rounds import percentiles
from bench.structured import BATCH, schema

RESULTS = Path(__file__).parent / "results" / "grammar_libs.json"
INSTALL = "pip install -e '.[bench]'  (or: pip install llguidance outlines-core)"
WORDS = ["harbour", "lantern", "copper", "meadow", "signal", "orchard", "granite", "willow"]
CITIES = ["Lisbon", "Nairobi", "Montevideo", "Tromsø"]


class Refused(Exception):
    """The library cannot compile the schema."""


def instance(i: int) -> dict[str, Any]:
    """A valid instance of ``schema(i)``, properties in the schema's order, arrays at their bound."""
    value = {
        f"name_{i}": f"Record {i} of the {WORDS[i % len(WORDS)]} series",
        "kind": [f"k{i}", f"k{i + 1}", "other"][i % 3],
        "tags": [WORDS[(i + j) % len(WORDS)] for j in range(4 + i % 5)],
        "where": {"city": CITIES[i % len(CITIES)], "zip": 1000 + 97 * i},
    }
    jsonschema.validate(value, schema(i))
    return value


def token_path(tokenizer: PreTrainedTokenizerBase, i: int, eos: int) -> list[int]:
    text = json.dumps(instance(i), separators=(", ", ": "), ensure_ascii=False)
    return [*tokenizer.encode(text, add_special_tokens=False), eos]


class Library:
    """One grammar library behind the four calls a serving engine makes."""

    name = ""
    first_rep_only = False  # a library whose compile takes seconds per schema runs in the first repetition alone

    def setup(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: int) -> None:
        raise NotImplementedError

    def compile(self, text: str) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        """Row ``i`` of ``bitmask`` [rows, ceil(vocab / 32)] int32 <- matcher ``i``'s allowed tokens."""
        raise NotImplementedError

    fill_parallel: Callable[[list[Any], torch.Tensor], None] | None = None

    def accept(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError


class XGrammar(Library):
    def __init__(self) -> None:
        self.name = f"xgrammar {_version('xgrammar')}"

    def setup(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: int) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # as the engine's
        self._batch = xgr.BatchGrammarMatcher(max_threads=os.cpu_count() or 1)
        self.fill_parallel = self._fill_parallel

    def compile(self, text: str) -> Any:
        try:
            return self._compiler.compile_json_schema(text, any_whitespace=False)
        except (RuntimeError, ValueError) as e:
            raise Refused(str(e)) from None

    def matcher(self, compiled: Any) -> Any:
        return xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)

    def _fill_parallel(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


class LLGuidance(Library):
    # the compact JSON the engine asks of xgrammar (any_whitespace=False)
    options: ClassVar[dict[str, object]] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def __init__(self) -> None:
        self._llg = _optional("llguidance")
        import llguidance.hf
        import llguidance.torch

        self.name = f"llguidance {_version('llguidance')}"
        self._hf: Any = llguidance.hf
        self._torch: Any = llguidance.torch

    def setup(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: int) -> None:
        self._tokenizer = self._hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._executor = self._llg.LLExecutor(num_threads=os.cpu_count() or 1)
        self.fill_parallel = self._fill_parallel

    def compile(self, text: str) -> Any:
        """An LLMatcher in its start state: a request's matcher is its ``deep_copy`` (shares the parser)."""
        try:
            grammar = self._llg.LLMatcher.grammar_from_json_schema(text, defaults=self.options)
            matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        except (RuntimeError, ValueError) as e:
            raise Refused(str(e)) from None
        if matcher.is_error():
            raise Refused(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for row, matcher in enumerate(matchers):
            self._torch.fill_next_token_bitmask(matcher, bitmask, row)

    def _fill_parallel(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self._torch.fill_next_token_bitmask_par(self._executor, [(m, row) for row, m in enumerate(matchers)], bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


class OutlinesCore(Library):
    """A regex from the schema, an Index (the token-level DFA) per regex, a Guide per request. It has
    no batch API. Its vocabulary takes each token's bytes, read from xgrammar's TokenizerInfo (timed
    as part of its setup)."""

    first_rep_only = True
    whitespace = "[ ]?"  # at least the engine's compact form (its regex builder puts it at every separator)

    def __init__(self) -> None:
        self._oc = _optional("outlines_core")
        from outlines_core.json_schema import build_regex_from_schema

        self.name = f"outlines-core {_version('outlines-core')}"
        self._regex = build_regex_from_schema

    def setup(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: int) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        special = set(tokenizer.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for token, text in enumerate(info.decoded_vocab):
            if token not in special and text:
                tokens.setdefault(text, []).append(token)
        self._vocabulary = self._oc.Vocabulary(eos, tokens)
        self._eos = eos

    def compile(self, text: str) -> Any:
        try:
            return self._oc.Index(self._regex(text, self.whitespace), self._vocabulary)
        except (RuntimeError, ValueError) as e:
            raise Refused(str(e)) from None

    def matcher(self, compiled: Any) -> Any:
        return self._oc.Guide(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        words = bitmask.shape[1]
        for row, guide in enumerate(matchers):
            guide.write_mask_into(bitmask[row].data_ptr(), words, 4)

    def accept(self, matcher: Any, token: int) -> bool:
        if token == self._eos:  # allowed in a final state's mask, though a Guide has no transition on it
            return bool(matcher.is_finished())
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True


def _optional(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise SystemExit(f"bench.grammar_libs needs {module}, an optional dependency: {INSTALL}") from None


def _version(distribution: str) -> str:
    from importlib.metadata import version

    return version(distribution)


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def allowed(bitmask: torch.Tensor, tokens: list[int]) -> list[bool]:
    """Whether row ``i``'s mask allows ``tokens[i]``."""
    ids = torch.tensor(tokens)
    words = bitmask[torch.arange(len(tokens)), ids // 32]
    return [bool(b) for b in ((words >> (ids % 32)) & 1).tolist()]


def walk(
    lib: Library, matchers: list[Any], paths: list[list[int]], bitmask: torch.Tensor, parallel: bool
) -> dict[str, Any]:
    """Every path to its end: fill the masks of the rows still on their path, check each row's path
    token is allowed, accept it. Fill and accept times (ms) of the steps where every row is on its
    path, and the rows a mask or an accept rejected."""
    fill = lib.fill_parallel if parallel and lib.fill_parallel is not None else lib.fill
    order = sorted(range(len(paths)), key=lambda row: -len(paths[row]))  # the rows still on their path lead
    fills, accepts, rejected = [], [], set()
    for step in range(max(map(len, paths))):
        active = [row for row in order if len(paths[row]) > step]
        live, tokens = [matchers[row] for row in active], [paths[row][step] for row in active]
        started = time.perf_counter()
        fill(live, bitmask[: len(active)])
        fill_ms = _ms(started)
        rejected |= {row for row, ok in zip(active, allowed(bitmask, tokens), strict=True) if not ok}
        started = time.perf_counter()
        accepted = [lib.accept(m, t) for m, t in zip(live, tokens, strict=True)]
        if len(active) == len(paths):
            fills.append(fill_ms)
            accepts.append(_ms(started))
        rejected |= {row for row, ok in zip(active, accepted, strict=True) if not ok}
    return {"fill_ms": fills, "accept_ms": accepts, "rejected": rejected}


def repetition(
    lib: Library,
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int,
    eos: int,
    texts: list[str],
    paths: list[list[int]],
) -> dict[str, Any]:
    started = time.perf_counter()
    lib.setup(tokenizer, vocab_size, eos)
    setup_ms = _ms(started)
    cache: dict[str, Any] = {}
    cold, cached, refused = [], [], {}
    for i, text in enumerate(texts):
        started = time.perf_counter()
        try:
            compiled = lib.compile(text)
        except Refused as e:
            refused[i] = str(e)[:300]
            continue
        cold.append(_ms(started))
        cache[hashlib.sha256(text.encode()).hexdigest()] = compiled
        started = time.perf_counter()
        lib.matcher(cache[hashlib.sha256(text.encode()).hexdigest()])
        cached.append(_ms(started))
    rows = [i for i in range(len(texts)) if i not in refused]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    walks: dict[str, Any] = {}
    for kind, parallel in (("cold", False), ("warm", False), ("parallel", True)):
        if parallel and lib.fill_parallel is None:
            continue
        grammars = [cache[hashlib.sha256(texts[i].encode()).hexdigest()] for i in rows]
        walks[kind] = walk(lib, [lib.matcher(g) for g in grammars], [paths[i] for i in rows], bitmask, parallel)
        walks[kind]["rejected"] = {rows[row] for row in walks[kind]["rejected"]}  # schema indices
    return {"setup_ms": setup_ms, "cold": cold, "cached": cached, "refused": refused, "walks": walks}


def apply_ms(vocab_size: int, rows: int, runs: int = 20) -> float:
    """xgrammar's CPU kernel applying a [rows] bitmask to [rows, vocab] fp32 logits (ms, p50)."""
    logits = torch.randn(rows, vocab_size)
    bitmask = xgr.allocate_token_bitmask(rows, vocab_size)
    bitmask[:, ::3] = 0
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size)
        times.append(_ms(started))
    return statistics.median(times)


def summarise(reps: list[dict[str, Any]], schemas: int) -> dict[str, Any]:
    cold = [t for r in reps for t in r["cold"]]
    cached = [t for r in reps for t in r["cached"]]
    summary: dict[str, Any] = {
        "setup_ms": [r["setup_ms"] for r in reps],
        "compile_cold_ms": {"p50": statistics.median(cold), "max": max(cold)} if cold else None,
        "compile_cached_ms": {"p50": statistics.median(cached), "max": max(cached)} if cached else None,
        "refused": len(reps[0]["refused"]),
        "refused_reasons": reps[0]["refused"],
        "rejected_valid_instance": sorted({row for r in reps for w in r["walks"].values() for row in w["rejected"]}),
        "batch": schemas - len(reps[0]["refused"]),
    }
    for kind in reps[0]["walks"]:
        fills = [t for r in reps for t in r["walks"][kind]["fill_ms"]]
        accepts = [t for r in reps for t in r["walks"][kind]["accept_ms"]]
        summary[f"mask_{kind}_ms"] = percentiles(fills)
        summary[f"accept_{kind}_ms"] = percentiles(accepts)
        summary["steps_per_walk"] = len(reps[0]["walks"][kind]["fill_ms"])
    return summary


def run(reps: int, schemas: int, libraries: list[Library]) -> dict[str, Any]:
    model_dir, _ = base_model_dir("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    eos = int(tokenizer.eos_token_id)
    texts = [json.dumps(schema(i)) for i in range(schemas)]
    paths = [token_path(tokenizer, i, eos) for i in range(schemas)]
    raw: dict[str, list[dict[str, Any]]] = {lib.name: [] for lib in libraries}
    for rep in range(reps):
        present = [lib for lib in libraries if rep == 0 or not lib.first_rep_only]
        for lib in present[rep % len(present) :] + present[: rep % len(present)]:
            raw[lib.name].append(repetition(lib, tokenizer, vocab_size, eos, texts, paths))
    return {
        "schemas": schemas,
        "reps": reps,
        "vocab_size": vocab_size,
        "path_tokens": {"min": min(map(len, paths)), "max": max(map(len, paths))},
        "threads_for_parallel_fill": os.cpu_count(),
        "apply_ms_p50": apply_ms(vocab_size, schemas),
        "libraries": {name: summarise(r, schemas) for name, r in raw.items()},
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"| {result['schemas']} schemas | setup ms | compile cold p50 / max ms | cached p50 ms | mask cold p50 / p95 ms "
        "| mask warm p50 / p95 ms | mask parallel p50 / p95 ms | accept p50 ms | refused | rejected |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in result["libraries"].items():

        def pair(key: str, a: str = "p50", b: str = "p95", row: dict[str, Any] = s) -> str:
            value = row.get(key)
            return f"{value[a]:.2f} / {value[b]:.2f}" if value else "-"

        accept = s.get("accept_warm_ms")
        lines.append(
            f"| {name} | {statistics.median(s['setup_ms']):.0f} | {pair('compile_cold_ms', b='max')} "
            f"| {s['compile_cached_ms']['p50'] if s['compile_cached_ms'] else float('nan'):.3f} "
            f"| {pair('mask_cold_ms')} | {pair('mask_warm_ms')} | {pair('mask_parallel_ms')} "
            f"| {accept['p50'] if accept else float('nan'):.2f} | {s['refused']} | {len(s['rejected_valid_instance'])} |"
        )
    lines.append("")
    lines.append(
        f"apply (xgrammar CPU kernel, [{result['schemas']}, {result['vocab_size']}]): {result['apply_ms_p50']:.2f} ms"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition of 4 schemas")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (libraries interleaved in each)")
    parser.add_argument("--no-outlines", action="store_true", help="leave outlines-core out (its compile is slow)")
    args = parser.parse_args()
    reps, schemas = (1, 4) if args.quick else (args.reps, BATCH)
    libraries: list[Library] = [XGrammar(), LLGuidance()]
    if not args.no_outlines:
        libraries.append(OutlinesCore())
    load_before = load_average()
    result = {
        "environment": environment(torch.get_num_threads()),
        "quick": args.quick,
        "load_average_before": load_before,
        **run(reps, schemas, libraries),
        "load_average_after": load_average(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2, ensure_ascii=False))
    RESULTS.with_suffix(".md").write_text(table(result) + "\n")
    print(table(result))
    print(f"\nload average before {load_before}, after {result['load_average_after']}\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
