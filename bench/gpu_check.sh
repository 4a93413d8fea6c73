#!/usr/bin/env bash
# The GPU check of issue #24, one command on a CUDA machine, a few minutes in all:
#   1. kernels:      tests/kernels/test_bgmv.py and test_sgmv.py with Triton compiled (TRITON_INTERPRET=0,
#                    LF_KERNEL_DEVICE=cuda), against the torch reference and the fp32 loop
#   2. cuda_tests:   the tests marked `cuda` (pytest -m cuda): the engine's captured decode graphs against
#                    its eager steps, and one host sync per engine step and per sampled batch
#   3. engine_bf16:  python -m bench.engine --quick --device cuda --dtype bfloat16
#   4. engine_graphs: the same with --cuda-graphs: the engine with and without CUDA graphs of its decode steps
#   5. multilora:    python -m bench.multilora --device cuda (batch 32, 32 distinct rank-16 adapters)
#   6. engine_peers: python -m bench.engine_peers --quick (built-in vs vLLM; skipped without .venv-vllm)
# Each step writes its JSON under bench/results/gpu/ and a log beside it; a summary closes the run.
# The GPU's settings are only read (nvidia-smi --query-gpu), never changed: no clocks, power, MIG or
# persistence mode. A failed step does not stop the others; the exit status is 1 if any failed.
#
# Usage: bench/gpu_check.sh    (PYTHON=... picks the interpreter, default .venv/bin/python;
#                               STEP_TIMEOUT=... caps each step, default 300 s)
set -uo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT=bench/results/gpu
STEP_TIMEOUT="${STEP_TIMEOUT:-300}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi --query-gpu=name --format=csv,noheader >/dev/null 2>&1; then
    echo "gpu_check: no CUDA GPU here (nvidia-smi is missing or sees no GPU); run it on a CUDA machine" >&2
    exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: $PY's torch cannot use CUDA (a CPU-only build?); install a CUDA torch or set PYTHON" >&2
    exit 2
fi

mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit,mig.mode.current \
    --format=csv >"$OUT/gpu.csv"
"$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")'

declare -A STATUS SECONDS_OF
run_step() {
    local name="$1"
    shift
    echo "== $name: $*"
    local start=$SECONDS
    timeout "$STEP_TIMEOUT" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    SECONDS_OF[$name]=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then STATUS[$name]=ok; else STATUS[$name]="FAILED (rc $rc, see $OUT/$name.log)"; fi
    grep -h '^Roofline' "$OUT/$name.log" || true
    echo "   ${STATUS[$name]} in ${SECONDS_OF[$name]} s"
}

run_step kernels env LF_KERNEL_DEVICE=cuda TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_bgmv.py tests/kernels/test_sgmv.py --junitxml="$OUT/kernels.xml"
run_step cuda_tests "$PY" -m pytest -q -p no:cacheprovider -m cuda \
    tests/worker/engine/test_cuda_graph.py tests/worker/engine/test_host_syncs.py --junitxml="$OUT/cuda_tests.xml"
run_step engine_bf16 "$PY" -m bench.engine --quick --device cuda --dtype bfloat16 --out "$OUT/engine.json"
run_step engine_graphs "$PY" -m bench.engine --quick --device cuda --dtype bfloat16 --cuda-graphs \
    --out "$OUT/engine_graphs.json"
run_step multilora "$PY" -m bench.multilora --device cuda --out "$OUT/multilora.json"
if [ -x .venv-vllm/bin/python ]; then
    run_step engine_peers "$PY" -m bench.engine_peers --quick --out "$OUT/engine_peers.json"
else
    STATUS[engine_peers]="skipped (no .venv-vllm: make venv-vllm)"
    SECONDS_OF[engine_peers]=0
    echo "== engine_peers: ${STATUS[engine_peers]}"
fi

echo
echo "## GPU check summary ($(head -2 "$OUT/gpu.csv" | tail -1))"
failed=0
for name in kernels cuda_tests engine_bf16 engine_graphs multilora engine_peers; do
    echo "- $name: ${STATUS[$name]} (${SECONDS_OF[$name]} s)"
    case "${STATUS[$name]}" in FAILED*) failed=1 ;; esac
done
"$PY" - "$OUT" <<'EOF'
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
summary: dict[str, object] = {}
for name, what in (("kernels", "kernels (compiled Triton)"), ("cuda_tests", "cuda tests (graphs, host syncs)")):
    if (out / f"{name}.xml").exists():
        suite = ET.parse(out / f"{name}.xml").getroot().find("testsuite")
        if suite is not None:
            summary[name] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            print("{}: {tests} tests, {failures} failures, {errors} errors, {skipped} skipped".format(what, **summary[name]))
if (path := out / "engine-bfloat16.json").exists():
    engine = json.loads(path.read_text())
    summary["engine_bf16"] = {
        r["batch"]: {"tok_s": r["systems"]["engine"]["tok_s"], "speedup_vs_hf": r["speedup_vs_hf"],
                     "tpot_vs_floor": r["tpot_vs_floor"]["engine"]}
        for r in engine["throughput"]
    }
    for batch, f in summary["engine_bf16"].items():
        print(f"engine bf16 batch {batch}: {f['tok_s']:.0f} tok/s, {f['speedup_vs_hf']:.2f}x hf, "
              f"TPOT {f['tpot_vs_floor']:.1f}x its floor")
if (path := out / "engine_graphs-bfloat16.json").exists():
    graphs = json.loads(path.read_text())
    summary["engine_graphs"] = {
        r["batch"]: {"tok_s": r["systems"]["engine_cuda_graphs"]["tok_s"], "speedup_vs_eager": r["cuda_graphs_speedup"],
                     "tpot_vs_floor": r["tpot_vs_floor"]["engine_cuda_graphs"]}
        for r in graphs["throughput"]
    }
    for batch, f in summary["engine_graphs"].items():
        print(f"engine bf16 + CUDA graphs batch {batch}: {f['tok_s']:.0f} tok/s, {f['speedup_vs_eager']:.2f}x eager, "
              f"TPOT {f['tpot_vs_floor']:.1f}x its floor")
if (path := out / "multilora.json").exists():
    m = json.loads(path.read_text())
    summary["multilora"] = {k: m[k] for k in ("ratio_vs_base", "speedup_vs_peft", "speedup_vs_hf")}
    summary["multilora"]["tpot_vs_floor"] = m["tpot_vs_floor"]["multilora"]
    summary["multilora"]["rank_skew"] = m["rank_skew"]["ratio"]
    print("multilora batch {}: ratio_vs_base {ratio_vs_base:.2f}, speedup_vs_peft {speedup_vs_peft:.2f}x, "
          "TPOT {tpot_vs_floor:.1f}x its floor, rank skew {rank_skew:.2f}x".format(m["batch_size"], **summary["multilora"]))
if (path := out / "engine_peers.json").exists():
    p = json.loads(path.read_text())
    summary["engine_peers"] = {k: p[k] for k in ("batch1_tpot_ratio_vs_vllm", "multilora_speedup_vs_vllm")}
    print("engine_peers: built-in / vLLM batch-1 TPOT {batch1_tpot_ratio_vs_vllm:.2f}x, "
          "multi-LoRA tok/s {multilora_speedup_vs_vllm:.2f}x".format(**summary["engine_peers"]))
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(f"wrote {out}/summary.json")
EOF
exit "$failed"
