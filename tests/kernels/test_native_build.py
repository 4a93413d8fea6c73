"""The native build's name covers everything compiled into it: every header a source includes is
hashed, so an edited header is a new build and a stale one is never loaded."""

import re

from kernels import native_build


def test_every_included_header_is_hashed() -> None:
    included = {
        name
        for source in native_build.SOURCES
        for name in re.findall(r'^#include "([^"]+)"', source.read_text(), flags=re.M)
    }
    assert included == {header.name for header in native_build.HEADERS}


def test_an_edited_header_changes_the_build_name(monkeypatch, tmp_path) -> None:
    header = tmp_path / "vec.h"
    header.write_text("// one\n")
    monkeypatch.setattr(native_build, "HEADERS", (header,))
    before = native_build.extension_name()
    assert native_build.extension_name() == before
    header.write_text("// two\n")
    assert native_build.extension_name() != before
