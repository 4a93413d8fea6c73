"""A file:// register source must lie inside a trusted directory (remote sources: tests/registry/remote/)."""

from pathlib import Path

import pytest

from services.registry.stores import trusted_source_dir
from shared.errors import InvalidRequest


def test_file_source_inside_a_trusted_directory(tmp_path: Path) -> None:
    (tmp_path / "trusted" / "sum").mkdir(parents=True)
    uri = (tmp_path / "trusted" / "sum").as_uri()
    assert trusted_source_dir(uri, (tmp_path / "trusted",)) == (tmp_path / "trusted" / "sum").resolve()


def test_symlink_or_dotdot_escaping_the_trusted_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "trusted").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "trusted" / "link").symlink_to(tmp_path / "outside")
    for path in (tmp_path / "trusted" / "link", tmp_path / "trusted" / ".." / "outside"):
        with pytest.raises(InvalidRequest, match="outside every trusted directory"):
            trusted_source_dir(f"file://{path}", (tmp_path / "trusted",))


def test_a_file_source_naming_a_host_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="may not name a remote host"):
        trusted_source_dir(f"file://evil.example{tmp_path}", (tmp_path,))
