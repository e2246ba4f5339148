"""W7's fused training step with large members' BatchNorm member by member ("after") against
one call over all members' channels ("before", main's rule), interleaved in one process on
identical weights and data; medians of the interleaved rounds.

Usage::

    OMP_NUM_THREADS=1 flock /tmp/bench.lock python benchmarks/w7_rules_timing.py 31
"""

import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import phalanx
from phalanx.backends.rules import _norm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_memory import _members

torch.set_num_threads(1)
torch.manual_seed(0)
ms, x, y = _members("w7")


def setmode(new):
    _norm.ALONE_BYTES = 1 << 18 if new else 1 << 60


stacks = {k: phalanx.stack(copy.deepcopy(ms), backend="fused") for k in ("old", "new")}
opts = {k: torch.optim.SGD(s.parameters(), lr=0.01) for k, s in stacks.items()}


def step(k):
    setmode(k == "new")
    opts[k].zero_grad()
    phalanx.member_losses(F.cross_entropy, stacks[k](x), y).sum().backward()
    opts[k].step()


for k in ("old", "new", "old", "new"):
    step(k)
t = {"old": [], "new": []}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 15):
    for k in ("old", "new") if r % 2 else ("new", "old"):
        s = time.perf_counter()
        step(k)
        t[k].append(time.perf_counter() - s)
mo, mn = statistics.median(t["old"]), statistics.median(t["new"])
print(
    f"W7 fused train step, median of {len(t['old'])} interleaved: before {mo * 1e3:.1f} ms, after {mn * 1e3:.1f} ms, after/before {mn / mo:.3f}"
)
