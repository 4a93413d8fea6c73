"""Where a register request may take adapter bytes from: uploads and trusted directories only."""

from pathlib import Path

import pytest

from services.registry.stores import trusted_source_dir
from shared.errors import InvalidRequest, ServiceUnavailable


def test_file_source_inside_a_trusted_directory(tmp_path: Path) -> None:
    (tmp_path / "trusted" / "sum").mkdir(parents=True)
    uri = (tmp_path / "trusted" / "sum").as_uri()
    assert trusted_source_dir(uri, (tmp_path / "trusted",), ()) == (tmp_path / "trusted" / "sum").resolve()


def test_symlink_or_dotdot_escaping_the_trusted_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "trusted").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "trusted" / "link").symlink_to(tmp_path / "outside")
    for path in (tmp_path / "trusted" / "link", tmp_path / "trusted" / ".." / "outside"):
        with pytest.raises(InvalidRequest, match="outside every trusted directory"):
            trusted_source_dir(f"file://{path}", (tmp_path / "trusted",), ())


@pytest.mark.parametrize("uri", ["https://hub.example/a", "http://10.0.0.1/a", "s3://bucket/a", "org/model-lora"])
def test_remote_sources_are_refused(uri: str) -> None:
    with pytest.raises(InvalidRequest, match="only uploads and file:// trusted directories are admitted"):
        trusted_source_dir(uri, (), ())


def test_allow_listed_remote_source_passes_the_check_but_is_not_fetched() -> None:
    with pytest.raises(ServiceUnavailable, match="allow-listed, but this registry does not fetch remote sources"):
        trusted_source_dir("https://models.internal/acme/sum", (), ("https://models.internal/",))
    with pytest.raises(InvalidRequest):
        trusted_source_dir("https://models.internal.evil/acme", (), ("https://models.internal/",))
