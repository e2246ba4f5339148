#!/usr/bin/env bash
# One-command GPU check: the CUDA tests, then `phalanx bench --device cuda` on every workload.
#
# Usage: benchmarks/gpu_check.sh OUTDIR
#
# Writes into OUTDIR: tests.txt (pytest tests/test_cuda.py), gpu.txt (nvidia-smi and torch's
# view of the device), bench-W1.txt .. bench-W7.txt (each workload's table, forward and
# train), bench-W1.json .. (every figure), and summary.txt (what passed, what timed out).
# Budget: about 8 minutes on one GPU. Each part has its own time limit, so one slow
# compilation cannot eat the others' time; a part that runs out is reported, not hidden.
# Not needed for CI. Run it from the repository root with the project's virtual environment
# (make .venv/.installed-stamp) holding a CUDA build of torch.
set -u -o pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
status=0

note() { echo "$*" | tee -a "$SUMMARY"; }

{ date -u; nvidia-smi || true; "$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())'; } > "$OUT/gpu.txt" 2>&1
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    note "no CUDA device visible to torch: see $OUT/gpu.txt"
    exit 2
fi

# 1. The CUDA tests: every backend, member_losses, clipping and the captured step on CUDA.
if timeout 150 "$PY" -m pytest -q -p no:cacheprovider "$ROOT/tests/test_cuda.py" > "$OUT/tests.txt" 2>&1; then
    note "tests/test_cuda.py: passed ($(tail -n 1 "$OUT/tests.txt"))"
else
    rc=$?
    note "tests/test_cuda.py: FAILED or timed out (exit $rc), see tests.txt"
    status=1
fi

# 2. The benchmark, one workload at a time (--quick: a few rounds each; the captured step's
# compilation is most of the time).
for w in W1 W2 W3 W4 W5 W6 W7; do
    if timeout 45 "$PY" -m phalanx_tools bench --device cuda --quick --workloads "$w" \
        --json "$OUT/bench-$w.json" > "$OUT/bench-$w.txt" 2>"$OUT/bench-$w.err"; then
        note "bench $w: ok"
    else
        rc=$?
        [ "$rc" -eq 124 ] && note "bench $w: timed out after 45 s" || note "bench $w: exit $rc (1: a contender is WRONG), see bench-$w.txt"
        status=1
    fi
done
grep -h -A20 '^Summary' "$OUT"/bench-W*.txt > "$OUT/bench-summary.txt" 2>/dev/null || true
note "figures: $OUT/bench-summary.txt and $OUT/bench-W*.txt"
exit $status
