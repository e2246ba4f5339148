"""How soon a script with ``phalanx.compile_step`` runs captured: first run and later runs.

Runs the README tour's step (8 members 10-20-2, per-member learning rates, ``max_norm=1.0``)
in fresh processes that share one new inductor cache folder, and prints for each run the
seconds from its first ``step()`` call to its first captured step, and to the choice between
the captured and the eager step. The first run compiles; later runs load the compiled step
from torch's caches and the choice from phalanx's record beside them.

    OMP_NUM_THREADS=1 python benchmarks/compile_start.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = """
import time
start_import = time.perf_counter()
import torch
import torch.nn.functional as F
from torch import nn
import phalanx
imported = time.perf_counter() - start_import
torch.manual_seed(0)
members = [nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)) for _ in range(8)]
stack = phalanx.stack(members)
x, y = torch.randn(32, 10), torch.randint(0, 2, (32,))
opt = phalanx.optim.Adam(stack.parameters(), lr=torch.logspace(-3, -1, 8))
step = phalanx.compile_step(stack, F.cross_entropy, opt, max_norm=1.0)
start = time.perf_counter()
captured = chosen = None
for call in range(40):
    step(x, y)
    if captured is None and step.compile_seconds is not None:
        captured = (call, time.perf_counter() - start)
    if chosen is None and step.choice is not None:
        chosen = (call, time.perf_counter() - start)
        break
print(
    f"import phalanx {imported:.2f} s; first captured step at call {captured[0]}, "
    f"{captured[1]:.2f} s after the first step(); choice '{step.choice}' at call {chosen[0]}, "
    f"{chosen[1]:.2f} s; compile_seconds {step.compile_seconds:.2f}"
)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="processes, the first one compiles")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for run in range(args.runs):
            out = subprocess.run(
                [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
            )
            label = "first run" if run == 0 else f"later run {run}"
            print(f"{label:12} {out.stdout.strip()}")


if __name__ == "__main__":
    main()
