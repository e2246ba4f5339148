"""Large stacked tensors on the CPU keep freed memory for reuse: checked in fresh processes,
since the setting is the process's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = """
import torch, phalanx, phalanx.backends._memory as m
from torch import nn
phalanx.stack([nn.Embedding({rows}, 1024) for _ in range(2)])
print(m._done)
"""


@pytest.mark.parametrize(
    ("rows", "env", "expected"),
    [(9000, {}, "True"), (100, {}, "False"), (9000, {"PHALANX_CPU_ALLOCATOR": "system"}, "False")],
    ids=["large", "small", "opted_out"],
)
def test_large_stacks_keep_freed_memory(rows, env, expected):
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(rows=rows)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == expected, out.stderr


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
        (600, "fused", {}, "False True"),  # 35 MB of activations for the two members
        (600, "vmap", {}, "False True"),
        (600, "loop", {}, "False False"),  # each member's own 17 MB: malloc reuses them
        (300, "fused", {}, "False False"),
        (600, "fused", {"PHALANX_CPU_ALLOCATOR": "system"}, "False False"),
    ],
    ids=["fused", "vmap", "loop", "small", "opted_out"],
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

    monkeypatch.setattr(m, "_done", False)
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
    assert m._done is False
