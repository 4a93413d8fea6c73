"""What every benchmark records and takes: the environment of a run (torch, threads, device, dtype,
CPU, commit, load) and the shared command-line arguments (rounds, pinned threads, device)."""

import argparse
import os
import platform
import subprocess
from pathlib import Path

import torch

from bench.roofline import physical_cores
from bench.rounds import DEFAULT_ROUNDS, QUICK_ROUNDS
from kernels.native import native_decode, native_lora


def load_average() -> dict[str, object]:
    """The machine's 1/5/15-minute load averages and ``uptime``'s line: figures on a shared box need them."""
    line = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    return {"load_1_5_15": list(os.getloadavg()), "cpus": os.cpu_count(), "uptime": line}


def cpu_bf16_flags() -> list[str]:
    """The CPU's native bf16 instruction sets (avx512_bf16, amx_bf16), from /proc/cpuinfo; [] elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted({"avx512_bf16", "amx_bf16"} & set(flags))


def environment(threads: int, dtype: str = "float32", device: str = "cpu") -> dict[str, object]:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    return {
        "torch": torch.__version__,
        "threads": threads,
        "device": device if device == "cpu" else f"{device} ({torch.cuda.get_device_name()})",
        "dtype": dtype,
        "cpu_linear": "auto",
        # auto: the native paged decode kernel where it built here (kernels/native.py), else the eager path
        "cpu_attention": "native"
        if device == "cpu" and dtype in ("float32", "bfloat16") and native_decode()
        else "torch",
        # auto: the native LoRA kernel where it built here (kernels/native.py), else the eager forms
        "cpu_lora": "native" if device == "cpu" and dtype in ("float32", "bfloat16") and native_lora() else "torch",
        "cpu": platform.processor() or platform.machine(),
        "cpu_bf16": cpu_bf16_flags(),
        "model": "SmolLM2-135M-Instruct",
        "python": platform.python_version(),
        "git_commit": commit or None,
    }


def rounds_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rounds",
        type=int,
        help=f"rounds, every system once in each (default {DEFAULT_ROUNDS}, {QUICK_ROUNDS} with --quick)",
    )


def threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=physical_cores(),
        help="torch intra-op threads, pinned (default: the machine's physical cores)",
    )


def device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="of the weights, KV cache and every system (the memory probe stays on the CPU)",
    )
