"""Large stacked tensors on the CPU keep freed memory for reuse: checked in fresh processes,
since the setting is the process's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import torch, phalanx, phalanx.core._memory as m
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
