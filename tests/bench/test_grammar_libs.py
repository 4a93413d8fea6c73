"""bench.grammar_libs: its token paths are valid instances every library accepts to the end, and a
path token a mask forbids is counted as a rejection, not timed past."""

import json
from pathlib import Path

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench.grammar_libs import Library, LLGuidance, XGrammar, allowed, repetition, token_path
from bench.structured import schema

SCHEMAS = 3


@pytest.fixture(scope="module")
def tokenizer(smollm_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm_dir)


def _texts() -> list[str]:
    return [json.dumps(schema(i)) for i in range(SCHEMAS)]


def _libraries() -> list[type[Library]]:
    """xgrammar, and llguidance where the [bench] extra is installed; outlines-core takes seconds per
    schema to compile, so only ``bench.grammar_libs`` runs it."""
    libraries: list[type[Library]] = [XGrammar]
    for module, library in (("llguidance", LLGuidance),):
        try:
            __import__(module)
        except ImportError:
            continue
        libraries.append(library)
    return libraries


@pytest.mark.parametrize("library", _libraries(), ids=lambda lib: lib.__name__)
def test_every_library_walks_every_valid_instance_to_its_end(tokenizer, library):
    eos = int(tokenizer.eos_token_id)
    paths = [token_path(tokenizer, i, eos) for i in range(SCHEMAS)]
    result = repetition(library(), tokenizer, len(tokenizer), eos, _texts(), paths)
    assert result["refused"] == {}
    assert len(result["cold"]) == SCHEMAS
    for walk in result["walks"].values():
        assert walk["rejected"] == set()
        assert len(walk["fill_ms"]) == min(map(len, paths))  # every step of the shortest path, all rows on


def test_a_token_outside_the_grammar_is_a_rejection(tokenizer):
    eos = int(tokenizer.eos_token_id)
    paths = [token_path(tokenizer, i, eos) for i in range(SCHEMAS)]
    paths[1] = [*tokenizer.encode("[", add_special_tokens=False), *paths[1][1:]]  # an object schema: no array
    result = repetition(XGrammar(), tokenizer, len(tokenizer), eos, _texts(), paths)
    assert all(walk["rejected"] == {1} for walk in result["walks"].values())


def test_allowed_reads_bit_t_mod_32_of_word_t_div_32():
    bitmask = xgr.allocate_token_bitmask(2, 64)
    bitmask.zero_()
    bitmask[0, 1] = 1 << 3  # token 35
    bitmask[1, 0] = -(1 << 31)  # token 31: the sign bit
    assert allowed(bitmask, [35, 31]) == [True, True]
    assert allowed(bitmask, [34, 63]) == [False, False]
