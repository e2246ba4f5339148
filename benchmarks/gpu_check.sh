#!/usr/bin/env bash
# The GPU check: the CUDA tests, then `phalanx bench --device cuda --quick` on W2 and W4, its
# results written into docs/GPU.md ("Last run of the check").
#
# Usage: benchmarks/gpu_check.sh OUTDIR [--dry]
#
#   --dry   runs everything it can on the CPU (tests/test_cuda.py with PHALANX_TEST_DEVICE=cpu,
#           the bench with --device cpu) with limits for a slow shared CPU: checks the script,
#           the tests and the report end to end on a machine without a GPU.
#
# Fits a first run, cold caches included, in 8 minutes of wall time on one GPU: the tests get
# 270 s (two cold inductor/Triton compilations of a training step among them: 9-19 s each on
# a CPU, the Triton autotuning on top is unmeasured), each workload 90 s (its captured step's
# compilation is most of it: 15-22 s on a CPU). 450 s in all, plus start-up. Each part has its own limit, so one slow compilation cannot take
# the others' time, and a part that runs out is reported, not hidden. Inductor's cache lives in
# OUTDIR/inductor-cache, so a second run reuses the compiled kernels. The limits can be set
# with GPU_CHECK_TESTS_S and GPU_CHECK_BENCH_S (seconds).
#
# Writes into OUTDIR: gpu.txt (nvidia-smi and torch's view of the device), tests.txt
# (pytest tests/test_cuda.py -rA), bench-W2.txt, bench-W4.txt (+ .json, .err), summary.txt,
# and report.md (what goes into docs/GPU.md). Exit status: 0 all passed, 1 something failed or
# timed out, 2 no CUDA device (without --dry).
set -u -o pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ] || { [ $# -eq 2 ] && [ "$2" != "--dry" ]; }; then
    echo "usage: $0 OUTDIR [--dry]" >&2
    exit 2
fi
OUT=$1
DRY=${2:-}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
export PYTHONPATH="$ROOT/src:$ROOT/tools/src${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="$OUT/inductor-cache"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
status=0
START=$(date +%s)

if [ -n "$DRY" ]; then
    DEVICE=cpu
    export PHALANX_TEST_DEVICE=cpu
    TESTS_S=${GPU_CHECK_TESTS_S:-900}
    BENCH_S=${GPU_CHECK_BENCH_S:-300}
else
    DEVICE=cuda
    TESTS_S=${GPU_CHECK_TESTS_S:-270}
    BENCH_S=${GPU_CHECK_BENCH_S:-90}
fi

note() { echo "$*" | tee -a "$SUMMARY"; }

{
    date -u
    nvidia-smi || true
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())'
} > "$OUT/gpu.txt" 2>&1
if [ -z "$DRY" ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    note "no CUDA device visible to torch: see $OUT/gpu.txt (use --dry to check the script on a CPU)"
    exit 2
fi
note "mode: ${DRY:-gpu} (device $DEVICE), limits: tests ${TESTS_S} s, each workload ${BENCH_S} s"

# 1. The CUDA tests: backends, fused optimizers, SGD, Lion, scaler, autocast, routed calls, the
#    captured step and its CUDA graphs. The bench test is left to part 2.
t0=$(date +%s)
if timeout "$TESTS_S" "$PY" -m pytest -rA -p no:cacheprovider "$ROOT/tests/test_cuda.py" \
    -k "not bench" > "$OUT/tests.txt" 2>&1; then
    note "tests/test_cuda.py: passed in $(( $(date +%s) - t0 )) s ($(tail -n 1 "$OUT/tests.txt" | tr -d '=' | xargs))"
else
    rc=$?
    [ "$rc" -eq 124 ] && why="timed out after $TESTS_S s" || why="FAILED (exit $rc)"
    note "tests/test_cuda.py: $why in $(( $(date +%s) - t0 )) s, see tests.txt: $(grep -cE '^FAILED' "$OUT/tests.txt") failed"
    status=1
fi

# 2. The benchmark, one workload at a time: W2 (tiny, launch-bound: where CUDA graphs pay)
#    and W4 (GEMM-bound).
for w in W2 W4; do
    t0=$(date +%s)
    if timeout "$BENCH_S" "$PY" -m phalanx_tools bench --device "$DEVICE" --quick --workloads "$w" \
        --json "$OUT/bench-$w.json" > "$OUT/bench-$w.txt" 2>"$OUT/bench-$w.err"; then
        note "bench $w: ok in $(( $(date +%s) - t0 )) s"
    else
        rc=$?
        [ "$rc" -eq 124 ] && note "bench $w: timed out after $BENCH_S s" || note "bench $w: exit $rc (1: a contender is WRONG), see bench-$w.txt"
        status=1
    fi
done
note "total: $(( $(date +%s) - START )) s of wall time"

# 3. The report, into docs/GPU.md.
"$PY" - "$OUT" "$ROOT/docs/GPU.md" "${DRY:-gpu}" <<'PYEOF'
import pathlib
import re
import sys

out, doc, mode = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
gpu = (out / "gpu.txt").read_text().splitlines()
lines = [
    "## Last run of the check",
    "",
    f"Mode: **{mode}**"
    + (" (on the CPU: `PHALANX_TEST_DEVICE=cpu`, `--device cpu`; not a GPU result)" if mode == "--dry" else "")
    + f". {gpu[0] if gpu else ''}; {next((g for g in gpu if g.startswith('torch ')), '')}.",
    "",
    "```",
    *(out / "summary.txt").read_text().splitlines(),
    "```",
    "",
]
tests = (out / "tests.txt").read_text().splitlines() if (out / "tests.txt").exists() else []
results = [t for t in tests if re.match(r"^(PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR) ", t)]
if results:
    lines += ["Tests (`pytest -rA tests/test_cuda.py`):", "", "```", *results, "```", ""]
for w in ("W2", "W4") if mode == "gpu" else ():  # a CPU's figures are not this page's
    f = out / f"bench-{w}.txt"
    if f.exists() and f.read_text().strip():
        lines += [f"`phalanx bench --quick --workloads {w}`:", "", "```", *f.read_text().rstrip().splitlines(), "```", ""]
text = doc.read_text()
head = text.split("## Last run of the check")[0].rstrip()
section = "\n".join(lines).rstrip() + "\n"
(out / "report.md").write_text(section)
doc.write_text(head + "\n\n" + section)
print(f"wrote {doc}")
PYEOF
exit $status
