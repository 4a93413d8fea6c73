"""docs/settings.md is what tools/settings_doc.py renders from the settings models today, and it describes
every variable lorafleet reads (shared/env_names.py), each with a meaning."""

import re
from pathlib import Path

from shared.env_names import DIRECT, SETTINGS
from tools import settings_doc

ROW = re.compile(r"^\| `(LF_[A-Z0-9_]+)` \| (.+?) \| (.+?) \| (.*) \|$", flags=re.M)


def test_docs_settings_md_is_current() -> None:
    written = settings_doc.TARGET.read_text() if settings_doc.TARGET.is_file() else ""
    assert written == settings_doc.render(), "docs/settings.md is not current: run python -m tools.settings_doc"


def test_every_variable_read_is_described_with_type_default_and_meaning() -> None:
    rows = ROW.findall(settings_doc.render())
    assert {name for name, *_ in rows} == SETTINGS | DIRECT
    assert [name for name, kind, default, meaning in rows if not (kind and default and meaning.strip())] == []


def test_a_field_reads_as_its_type_bounds_default_and_description() -> None:
    rows = {name: (kind, default, meaning) for name, kind, default, meaning in ROW.findall(settings_doc.render())}
    assert rows["LF_ENGINE__KV_CACHE_BYTES"] == (
        "int, ≥ 2^16, ≤ 2^40",
        "`536870912` (512 MiB)",
        "byte budget of the KV cache (all layers, K and V)",
    )
    assert rows["LF_CACHE__POLICY"][:2] == ("`heat` \\| `lru` \\| `lfu`", "`heat`")
    assert rows["LF_LORA__RANK_CLASSES"][1] == "`[8, 16, 32, 64]`"
    assert rows["LF_NATS_PASSWORD_FILE"][:2] == ("path (optional)", "unset")


def test_check_fails_on_a_stale_file_and_names_the_fix(tmp_path: Path, monkeypatch, capsys) -> None:
    stale = tmp_path / "settings.md"
    stale.write_text(settings_doc.render().replace("`LF_ENGINE__DTYPE`", "`LF_ENGINE__" + "DTYP`"))
    monkeypatch.setattr(settings_doc, "TARGET", stale)
    assert settings_doc.main(["--check"]) == 1
    assert "run python -m tools.settings_doc" in capsys.readouterr().err
    monkeypatch.setattr(settings_doc, "REPO", tmp_path)
    assert settings_doc.main([]) == 0
    assert settings_doc.main(["--check"]) == 0
