"""Stacked tensors on the CPU keep freed memory for reuse: checked in fresh processes, since
the setting is the process's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import torch, phalanx, phalanx.core._memory as m
from torch import nn
for rows in {rows}:
    phalanx.stack([nn.Embedding(rows, 1024) for _ in range(2)])
    print(m._done)
"""


def _levels(rows: list[int], env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(rows=rows)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.split()


# Embedding(rows, 1024) is 4 KiB a row: 10 rows 40 KiB (under glibc's default mmap threshold,
# 128 KiB), 100 rows 400 KiB (heap blocks kept), 9000 rows 36 MiB (over 32 MiB: every block).
@pytest.mark.parametrize(
    ("rows", "env", "expected"),
    [
        ([9000], {}, ["2"]),
        ([100], {}, ["1"]),
        ([10], {}, ["0"]),
        ([100, 10, 9000, 100], {}, ["1", "1", "2", "2"]),
        ([9000, 100], {"PHALANX_CPU_ALLOCATOR": "system"}, ["0", "0"]),
    ],
    ids=["large", "medium", "small", "raised_never_lowered", "opted_out"],
)
def test_stacks_keep_freed_memory(rows, env, expected):
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt")
    assert _levels(rows, env) == expected


MEDIUM = """
import resource, torch, phalanx
from torch import nn
torch.set_num_threads(1)
class Critic(nn.Module):  # the TD3 critic's shape: two heads of 256 wide, per-member inputs
    def __init__(self):
        super().__init__()
        self.q = nn.ModuleList([nn.Sequential(nn.Linear(23, 256), nn.ReLU(), nn.Linear(256, 256),
                                              nn.ReLU(), nn.Linear(256, 1)) for _ in range(2)])
    def forward(self, x):
        return self.q[0](x), self.q[1](x)
stack = phalanx.stack([Critic() for _ in range(16)])
opt = phalanx.optim.Adam(stack.parameters(), fused=True)
x = torch.randn(16, 256, 23)
def step():
    opt.zero_grad(set_to_none=True)
    q1, q2 = stack(x, in_dims=(0,))
    (q1.square().sum() + q2.square().sum()).backward()
    opt.step()
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(25):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_medium_stack_steps_do_not_fault_in_fresh_pages():
    # 4 MiB weights and activations, no tensor over 32 MiB. With glibc's defaults most steps
    # give the freed activations back and fault them in again (about 130000 minor faults over
    # the 25 steps, 4 KiB each, measured here); kept, about 1000 (one heap growth).
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt")

    def faults(env: dict[str, str]) -> int:
        out = subprocess.run(
            [sys.executable, "-c", MEDIUM],
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return int(out.stdout)

    kept, system = faults({}), faults({"PHALANX_CPU_ALLOCATOR": "system"})
    assert kept * 4 < system, (kept, system)
