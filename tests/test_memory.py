"""Stacked tensors on the CPU keep freed memory for reuse: checked in fresh processes, since
the setting is the process's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = """
import torch, phalanx, phalanx.backends._memory as m
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


# Embedding(rows, 1024) is 4 KiB a row, two members: 10 rows 80 KiB (under glibc's default
# mmap threshold, 128 KiB), 100 rows 800 KiB (heap blocks kept), 9000 rows 72 MiB (over
# 32 MiB: every block); 16 and 4096 rows are exactly 128 KiB and 32 MiB, whose blocks (the
# bytes plus malloc's alignment and header) are over those thresholds.
@pytest.mark.parametrize(
    ("rows", "env", "expected"),
    [
        ([9000], {}, ["2"]),
        ([4096], {}, ["2"]),
        ([100], {}, ["1"]),
        ([16], {}, ["1"]),
        ([10], {}, ["0"]),
        ([100, 10, 9000, 100], {}, ["1", "1", "2", "2"]),
        ([9000, 100], {"PHALANX_CPU_ALLOCATOR": "system"}, ["0", "0"]),
    ],
    ids=["large", "exactly_32_mib", "medium", "exactly_128_kib", "small", "raised_never_lowered",
         "opted_out"],
)  # fmt: skip
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


def _faults(script: str, env: dict[str, str]) -> int:
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout)


def test_medium_stack_steps_do_not_fault_in_fresh_pages():
    # 4 MiB weights and activations, no tensor over 32 MiB. With glibc's defaults most steps
    # give the freed activations back and fault them in again (about 130000 minor faults over
    # the 25 steps, 4 KiB each, measured here); kept, about 1000 (one heap growth).
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt")
    kept, system = _faults(MEDIUM, {}), _faults(MEDIUM, {"PHALANX_CPU_ALLOCATOR": "system"})
    assert kept * 4 < system, (kept, system)


EXACTLY_32_MIB = """
import resource, torch, phalanx
from torch import nn
torch.set_num_threads(1)
stack = phalanx.stack([nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
                       for _ in range(2048)])
opt = phalanx.optim.Adam(stack.parameters(), fused=True)
x = torch.randn(64, 64)  # each hidden activation of all members: 2048 x 64 x 64 floats
def step():
    opt.zero_grad(set_to_none=True)
    stack(x).square().sum().backward()
    opt.step()
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_activations_of_exactly_32_mib_do_not_fault_in_fresh_pages():
    # W6 of DESIGN.md (2048 tiny MLPs): its activations are 2**25 bytes, whose blocks glibc
    # mapped afresh every step while phalanx counted them as "up to 32 MiB"; measured on its
    # captured step, 32772 minor faults a step and 228 ms against none and 160 ms
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt")
    kept = _faults(EXACTLY_32_MIB, {})
    system = _faults(EXACTLY_32_MIB, {"PHALANX_CPU_ALLOCATOR": "system"})
    assert kept * 4 < system, (kept, system)


ACTIVATIONS = """
import torch, phalanx, phalanx.backends._memory as m
from torch import nn
torch.manual_seed(0)
stack = phalanx.stack([nn.Conv2d(1, 8, 3) for _ in range(2)], backend={backend!r})
before = m._done
stack(torch.randn({batch}, 1, 32, 32))  # all members' output: batch * 2 * 8 * 30 * 30 floats
print(before, m._done)
"""


@pytest.mark.parametrize(
    ("batch", "backend", "env", "expected"),
    [
        (600, "fused", {}, "0 2"),  # 35 MB of activations for the two members: every block
        (600, "vmap", {}, "0 2"),
        (600, "loop", {}, "0 0"),  # each member's own 17 MB: no batched tensor
        (300, "fused", {}, "0 1"),  # 17 MB: blocks up to 32 MiB kept
        (600, "fused", {"PHALANX_CPU_ALLOCATOR": "system"}, "0 0"),
    ],
    ids=["fused", "vmap", "loop", "medium", "opted_out"],
)
def test_large_batched_activations_keep_freed_memory(batch, backend, env, expected):
    # W7 of DESIGN.md: small weights, 44 MB of activations for its 16 members; the
    # page faults of mapping them afresh each step were the fused step's loss to the loop
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt")
    out = subprocess.run(
        [sys.executable, "-c", ACTIVATIONS.format(batch=batch, backend=backend)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == expected, out.stderr


def test_without_glibc_mallopt_is_looked_up_once(monkeypatch):
    # a rule asks on every call with large activations: where there is no mallopt (macOS,
    # musl), the slow library lookup must not run every step
    import phalanx.backends._memory as m

    monkeypatch.setattr(m, "_done", 0)
    monkeypatch.setattr(m, "_unavailable", False)
    monkeypatch.delenv("PHALANX_CPU_ALLOCATOR", raising=False)
    lookups = []

    def find_library(name):
        lookups.append(name)
        return "libc-not-here.so"

    monkeypatch.setattr(m.ctypes.util, "find_library", find_library)
    big = m.LARGE + 1
    assert m.reuse_freed_memory(big) is False
    assert m.reuse_freed_memory(big) is False
    m.note_batched([torch.empty(big // 4 + 1)])
    assert lookups == ["c"]
    assert m._done == 0
