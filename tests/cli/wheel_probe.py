"""Run by tests/cli/test_wheel_install.py with the interpreter of an environment the wheel was installed
into (``python -I``: no PYTHONPATH, no checkout on the path). Prints one JSON object: where each
package was imported from, the package data it read, and the exit status of ``--help`` of every
``lorafleet`` subcommand, enumerated from the command's own parser."""

import argparse
import asyncio
import contextlib
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every subcommand path under ``parser``, nested ones included (argparse keeps them in its actions)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name)
                yield from commands(sub, (*path, name))


def help_status(argv: list[str]) -> tuple[int, str]:
    from lorafleet.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main([*argv, "--help"])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue()


async def dashboard_page() -> tuple[int, str]:
    """GET /dashboard from the gateway's own router, in process."""
    import httpx
    from fastapi import FastAPI

    from services.gateway.dashboard import router

    app = FastAPI()
    app.include_router(router)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        response = await client.get("/dashboard")
    return response.status_code, response.text


def main() -> None:
    import kernels
    import lorafleet
    import services
    import shared
    from kernels import native_build
    from lorafleet.cli.demo_fit import DEMO_ADAPTERS
    from lorafleet.cli.eval_cmd import eval_set_path
    from lorafleet.cli.main import build_parser
    from lorafleet.evaluation.runner import load_eval_set
    from shared.adapter_format import read_adapter_dir

    status, page = asyncio.run(dashboard_page())
    demos = sorted(p.name for p in DEMO_ADAPTERS.iterdir() if p.is_dir())
    helps = {}
    for path in commands(build_parser()):
        code, text = help_status(list(path))
        helps[" ".join(path)] = {"status": code, "usage": text.startswith("usage:"), "tail": text[-300:]}
    print(
        json.dumps(
            {
                "prefix": sys.prefix,
                "packages": {m.__name__: str(Path(m.__file__).parent) for m in (kernels, lorafleet, services, shared)},
                "dashboard": {"status": status, "page": page},
                "kernel_sources": [str(s) for s in native_build.SOURCES + native_build.HEADERS if s.is_file()],
                "kernel_extension": native_build.extension_name(),
                "demo_adapters": {
                    name: {
                        "dir": str(DEMO_ADAPTERS / name),
                        "eval_items": len(load_eval_set(eval_set_path(name, None)).items),
                        "adapter_files": sorted(read_adapter_dir(DEMO_ADAPTERS / name / "adapter")),
                    }
                    for name in demos
                },
                "helps": helps,
            }
        )
    )


if __name__ == "__main__":
    main()
