"""bench.quant_evals: the demo adapters' eval sets answered on quantized weights and scored as the
registry's release evaluation scores them (the embedded SmolLM2, two items a set)."""

import json

from bench.quant_evals import REFERENCE, demo_sets, main
from shared.eval_scorers import scorer


def test_every_demo_adapter_has_a_set_with_a_threshold():
    sets = demo_sets()
    assert sorted(sets) == ["capital-answer", "json-extract", "sql-employees"]
    assert all(spec.items and spec.meta.threshold > 0 for spec in sets.values())
    assert all(len(spec.items) == 1 for spec in demo_sets(1).values())


def test_a_short_run_scores_each_answer_with_its_items_scorer_and_reports_a_refused_format(tmp_path, capsys):
    out = tmp_path / "quant_evals.json"
    main(["--systems", "int8", "int4-g128", "--items", "2", "--threads", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["scores"]) == {REFERENCE, "int8"}  # bf16 always runs: the answers are compared with it
    assert "divisible by the group size" in result["refused"]["int4-g128"]  # 576 input features, groups of 128
    sets = demo_sets(2)
    for system, texts in result["answers"].items():
        for adapter, spec in sets.items():
            assert len(texts[adapter]) == 2 and all(texts[adapter])
            expected = sum(scorer(i.scorer)(t, i.expected) for i, t in zip(spec.items, texts[adapter], strict=True)) / 2
            assert result["scores"][system][adapter] == expected
            same = sum(a == b for a, b in zip(texts[adapter], result["answers"][REFERENCE][adapter], strict=True))
            assert result["same_as_reference"][system][adapter] == same
    assert result["same_as_reference"][REFERENCE] == dict.fromkeys(sets, 2)
    assert "| capital-answer | 2 |" in capsys.readouterr().out
