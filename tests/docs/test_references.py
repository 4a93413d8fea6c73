"""The README and docs/*.md name only what exists: every backticked repository path (a file, a folder or a
glob), every backticked ``module:symbol`` / ``module.symbol`` (found by reading the module's source, so a
module that needs vLLM or a GPU is checked too), every backticked bare class (``Class``, ``Class.member``)
or private name (``_name``) somewhere in the code (name another library's class with its module:
``contextlib.AsyncExitStack``), and every relative markdown link's target with its ``#fragment``."""

import ast
import builtins
import fnmatch
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
PACKAGES = ("services", "shared", "kernels", "lorafleet", "bench", "tools", "tests")
# Paths the docs may name that a checkout holds only once a command wrote them: what .gitignore names.
WRITTEN_LATER = tuple(
    line.strip().strip("/")
    for line in (REPO / ".gitignore").read_text().splitlines()
    if line.strip() and not line.startswith(("#", "!"))
)

SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^\.?[A-Za-z0-9_.-]+(/[A-Za-z0-9_.*-]+)+/?$")
BARE = re.compile(r"^(?:([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)(?:\.(\w+))?|(_[a-z]\w*))(?:\(\))?$")
SYMBOL = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.\w+)+(?::\w+(?:\.\w+)*)?$")
FILE_SYMBOL = re.compile(r"^([A-Za-z0-9_./-]+\.py):(\w+(?:\.\w+)*)$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def spans(doc: Path) -> Iterator[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)  # code blocks hold commands
    yield from SPAN.findall(text)


def is_repository_path(span: str) -> bool:
    top = span.split("/")[0]
    return bool(PATH.match(span)) and (top in PACKAGES or (REPO / top).exists() or top == ".lorafleet")


def path_exists(span: str) -> bool:
    path = span.removeprefix("./").rstrip("/")
    if any(
        path == ignored or path.startswith(ignored + "/") or fnmatch.fnmatch(path, ignored) for ignored in WRITTEN_LATER
    ):
        return True
    if "*" in span:
        return any(REPO.glob(span))
    return (REPO / span).exists()


@cache
def definitions(source: Path) -> dict[str, set[str]]:
    """Top-level names of a module ("" -> names), and each top-level class's own names."""
    tree = ast.parse(source.read_text())
    found: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        found[""] |= _bound(node)
        if isinstance(node, ast.ClassDef):
            found[node.name] = set().union(*(_bound(child) for child in node.body))
    return found


def _bound(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, ast.ImportFrom | ast.Import):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    if isinstance(node, ast.If | ast.Try):
        return set().union(*(_bound(child) for child in node.body), set())
    return set()


def module_source(dotted: str) -> Path | None:
    base = REPO.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def symbol_exists(source: Path, symbol: str) -> bool:
    head, _, attribute = symbol.partition(".")
    names = definitions(source)
    if head not in names[""]:
        return False
    return not attribute or attribute.split(".")[0] in names.get(head, set())


def reference_exists(span: str) -> bool:
    """``module:symbol`` or ``module.symbol[.attribute]``: the longest prefix that is a module, then the rest
    defined in it."""
    module, colon, symbol = span.partition(":")
    if colon:
        source = module_source(module)
        return source is not None and symbol_exists(source, symbol)
    parts = span.split(".")
    for cut in range(len(parts), 0, -1):
        source = module_source(".".join(parts[:cut]))
        if source is not None:
            return cut == len(parts) or symbol_exists(source, ".".join(parts[cut:]))
    return False


@cache
def code_names() -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """Every name the code defines anywhere (functions, classes, assignments, nested ones too, and the C++
    classes of kernels/csrc), and each class's own members."""
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    for package in PACKAGES:
        for source in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.stmt):
                    names |= _bound(node)
                if isinstance(node, ast.ClassDef):
                    members.setdefault(node.name, set()).update(*(_bound(child) for child in node.body))
    for source in (REPO / "kernels" / "csrc").glob("*"):
        names |= set(re.findall(r"^(?:class|struct) (\w+)", source.read_text(), flags=re.M))
    return frozenset(names), {name: frozenset(own) for name, own in members.items()}


def bare_name_exists(span: str) -> bool:
    match = BARE.match(span)
    if match is None or (REPO / span).exists():  # not a bare name, or a top-level file (`Dockerfile`)
        return True
    cls, member, private = match.groups()
    names, members = code_names()
    if private:
        return private in names
    if member is None and hasattr(builtins, cls):  # `ValueError`
        return True
    return cls in names and (member is None or member in members.get(cls, frozenset()))


def missing_references(doc: Path) -> list[str]:
    missing = []
    for span in spans(doc):
        if not bare_name_exists(span):
            missing.append(span)
        elif match := FILE_SYMBOL.match(span):
            path, symbol = match.groups()
            if not ((REPO / path).is_file() and symbol_exists(REPO / path, symbol)):
                missing.append(span)
        elif SYMBOL.match(span):
            if not reference_exists(span):
                missing.append(span)
        elif is_repository_path(span) and not path_exists(span):
            missing.append(span)
    return missing


def anchors(doc: Path) -> set[str]:
    """The fragment GitHub gives each heading of ``doc``: lower case, punctuation dropped, spaces as ``-``."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def missing_links(doc: Path) -> list[str]:
    """Relative links whose file is missing, or whose ``#fragment`` names no heading of that file."""
    missing = []
    for target in LINK.findall(re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        linked = (doc.parent / path) if path else doc
        if not linked.exists() or (fragment and linked.suffix == ".md" and fragment not in anchors(linked)):
            missing.append(target)
    return missing


def test_every_backticked_path_and_symbol_in_the_docs_exists() -> None:
    missing = {str(doc.relative_to(REPO)): found for doc in DOCS if (found := missing_references(doc))}
    assert missing == {}


def test_every_relative_link_in_the_docs_has_a_target() -> None:
    missing = {str(doc.relative_to(REPO)): found for doc in DOCS if (found := missing_links(doc))}
    assert missing == {}


def test_the_checks_catch_what_is_gone() -> None:
    assert reference_exists("shared.subjects:worker_dispatch") and reference_exists(
        "services.gateway.settings.GatewaySettings"
    )
    assert reference_exists("shared.config:CommonSettings.nats_credentials")
    assert not reference_exists("services.scheduler.grants:Grants")  # the drift: a file that is gone
    assert not reference_exists("shared.config:CommonSettings.check")
    assert is_repository_path("services/gateway/app.py") and not path_exists("services/gateway/catalog_mirror.py")
    assert not is_repository_path("/opt/lorafleet/kernels") and not is_repository_path("adapter_config.json")
    assert path_exists("deploy/tls") and path_exists("bench/results/x.json")  # git-ignored: written by a command
    assert bare_name_exists("Dispatcher.submit") and bare_name_exists("_split") and bare_name_exists("DecoderStack")
    assert not bare_name_exists("Grants.check") and not bare_name_exists("BoundedLabel")
    assert bare_name_exists("TimeoutError") and bare_name_exists("contextlib.AsyncExitStack")
    assert not bare_name_exists("_follow_quotas")
    assert "vllm-workers" in anchors(REPO / "docs" / "operations.md")
    assert "dashboard-and-metrics" in anchors(REPO / "docs" / "operations.md")


def test_a_missing_link_target_or_fragment_is_caught(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text(
        "[a](gone.md) [b](#nowhere) [c](#the-heres-heading) [d](https://example.com)\n\n## The here's heading\n"
    )
    assert missing_links(doc) == ["gone.md", "#nowhere"]
