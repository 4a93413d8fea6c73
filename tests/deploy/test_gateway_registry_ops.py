"""The gateway's NATS user may send exactly the registry ops the gateway's code sends (read from the
code it runs, shared modules included); the operator-only ops (evals, releases, signer keys, sources)
are refused to it and left to the admin user."""

import ast
from pathlib import Path

import pytest

from lorafleet.cli.nats_permissions import GATEWAY_REGISTRY_OPS
from shared import subjects
from tests.deploy.compose_files import REPO


def imported_modules(package: str) -> list[Path]:
    """Every file of ``package`` and every repository module they import, transitively (``shared``
    included): the code a service runs."""
    todo = sorted((REPO / package.replace(".", "/")).rglob("*.py"))
    seen: set[Path] = set()
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in (n for n in names if n.split(".")[0] in ("shared", "services")):
                path = REPO / name.replace(".", "/")
                todo += [f for f in (path.with_suffix(".py"), path / "__init__.py") if f.is_file()]
    return sorted(seen)


def sent_registry_ops(files: list[Path]) -> set[str]:
    """Every registry op the code names in a call to ``registry_call`` or ``subjects.registry``."""
    ops: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("registry_call", "registry"):
                ops |= {a.value for a in node.args if isinstance(a, ast.Constant) and a.value in subjects.REGISTRY_OPS}
    return ops


def test_the_gateway_may_send_exactly_the_registry_ops_its_code_sends() -> None:
    files = imported_modules("services.gateway")
    assert REPO / "shared" / "catalog" / "view.py" in files and REPO / "services" / "registry" / "ops.py" not in files
    sent = sent_registry_ops(files)
    assert len(sent) >= 15 and sent == set(GATEWAY_REGISTRY_OPS)
    assert not {"record_eval", "release_start", "release_status", "trust_key"} & sent


@pytest.mark.parametrize("op", ["record_eval", "release_start", "release_status", "trust_key", "source_approve"])
async def test_the_gateway_cannot_call_operator_only_registry_ops(connect_as, op: str) -> None:
    gateway = await connect_as("gateway")
    assert await gateway.publish_refused(subjects.registry(op))
    assert not await (await connect_as("admin")).publish_refused(subjects.registry(op))
