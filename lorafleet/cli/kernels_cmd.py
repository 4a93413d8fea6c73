"""``lorafleet kernels build`` and ``lorafleet kernels status``: the native CPU kernels built ahead of
serving (an image's build step, a host before its workers start), and what is built where for this CPU
(kernels/native_build.py)."""

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a subcommand runs: kernels/ imports torch, which the other subcommands never need
    from kernels.native_build import KernelSettings

ISA = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the instruction sets the kernels' paths differ by


def _settings(args: argparse.Namespace) -> "KernelSettings":
    from kernels.native_build import KernelSettings

    given = {"dir": args.dir, "build_timeout_s": args.timeout, "build_jobs": args.jobs}
    return KernelSettings(**{k: v for k, v in given.items() if v is not None})


def build(args: argparse.Namespace) -> int:
    from kernels.native_build import KernelBuildError, extension_name, library

    settings = _settings(args)
    name = extension_name()
    print(f"kernels {name}: looking in {', '.join(str(d) for d in settings.search_dirs())}", flush=True)
    try:
        found = library(settings)
    except KernelBuildError as e:
        print(f"kernels {name}: not built: {e}")
        return 1
    if found.origin == "built":
        print(f"kernels {name}: built in {found.build_s:.0f} s at {found.path}")
    else:
        print(f"kernels {name}: already built ({found.origin}) at {found.path}")
    return 0


def status(args: argparse.Namespace) -> int:
    """One line per searched directory; exit 0 where a library for this CPU is found."""
    from kernels.native_build import builder_active, cpu_flags, extension_name, find, record

    settings = _settings(args)
    name = extension_name()
    flags = set(cpu_flags().split())
    print(f"extension {name} (this CPU: {' '.join(f for f in ISA if f in flags) or 'none of ' + ', '.join(ISA)})")
    *prebuilt, cache = settings.search_dirs()
    chosen = None
    for directory, role in [*((d, "prebuilt") for d in prebuilt), (cache, "cache")]:
        found = find(directory, name)
        if found:
            built = record(directory, name) or {}
            state = f"built {built.get('built_at', '?')} in {built.get('seconds', '?')} s: {found}"
            chosen = chosen or found
        elif builder_active(directory, name):
            state = "a build is under way"
        elif (directory / name / "lock").exists():
            state = "incomplete, with a stale torch lock (the next build removes it)"
        else:
            state = "not built"
        print(f"  {role:<8} {directory}: {state}")
    print(f"loads: {chosen}" if chosen else "loads: nothing yet (a worker builds at start; `lorafleet kernels build`)")
    return 0 if chosen else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument(
        "--dir", type=Path, help="the writable kernel cache (default LF_KERNELS_DIR, else torch's extensions dir)"
    )
    opts.add_argument("--timeout", type=float, help="seconds a build may take (default LF_KERNELS_BUILD_TIMEOUT_S)")
    opts.add_argument("--jobs", type=int, help="compilers at once, about 1.4 GB each (default LF_KERNELS_BUILD_JOBS)")
    kernels = subparsers.add_parser(
        "kernels", help="the native CPU kernels: build ahead of serving, show what is built"
    )
    sub = kernels.add_subparsers(dest="kernels_cmd", required=True)
    sub.add_parser(
        "build",
        parents=[opts],
        help="build this CPU's kernels into the cache; a second run finds them (an image ships the --dir it "
        "built into as LF_KERNELS_PREBUILT)",
    ).set_defaults(func=build)
    sub.add_parser(
        "status", parents=[opts], help="which directories hold this CPU's kernels; exit 1 where none does"
    ).set_defaults(func=status)
