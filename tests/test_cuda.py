"""The same checks on a GPU: every backend against the loop of independent copies on CUDA.

These run only where CUDA is available (the CI machine has none; a GPU machine runs them
with `pytest tests/test_cuda.py`).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import phalanx
from helpers import ARCHS, assert_close, make_members, reference_outputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA_ARCHS = [a for a in ARCHS if a.name in ("question2", "cnn_batchnorm_pool", "dict_output")]


@pytest.mark.parametrize("backend", ["loop", "vmap", "fused", "auto"])
@pytest.mark.parametrize("arch", CUDA_ARCHS, ids=[a.name for a in CUDA_ARCHS])
def test_backends_match_loop_on_cuda(backend, arch):
    torch.manual_seed(0)
    members = [m.cuda() for m in make_members(arch, 4)]
    reference = copy.deepcopy(members)
    stack = phalanx.stack(members, backend=backend)
    assert stack.module.get_parameter(next(iter(dict(stack.module.named_parameters())))).is_cuda
    kwargs = {"scale": 0.5} if arch.name == "dict_output" else {}
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
    ref_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in reference]
    for _ in range(5):
        args = tuple(a.cuda() for a in arch.inputs(6))
        out = stack(*args, **kwargs)
        assert_close(out, reference_outputs(reference, args, (None,) * len(args), kwargs))
        leaves = torch.utils._pytree.tree_leaves(out)
        opt.zero_grad()
        sum(leaf.square().mean(dim=tuple(range(1, leaf.dim()))).sum() for leaf in leaves).backward()
        opt.step()
        for m, o in zip(reference, ref_opts):
            o.zero_grad()
            ref_leaves = torch.utils._pytree.tree_leaves(m(*args, **kwargs))
            sum(leaf.square().mean() for leaf in ref_leaves).backward()
            o.step()
    params, buffers = stack.stacked_state()
    for name, p in {**params, **buffers}.items():
        for i, m in enumerate(reference):
            assert_close(p[i], m.state_dict()[name], msg=f"member {i} {name}", trajectory=True)


def test_member_losses_and_clipping_on_cuda():
    stack = phalanx.stack([m.cuda() for m in make_members(ARCHS[1], 3)])
    x, y = torch.randn(8, 10, device="cuda"), torch.randint(0, 2, (8,), device="cuda")
    losses = phalanx.member_losses(F.cross_entropy, stack(x), y)
    losses.sum().backward()
    norms = phalanx.clip_grad_norm_(stack.parameters(), max_norm=0.1)
    assert losses.shape == norms.shape == (3,)
    assert losses.is_cuda and norms.is_cuda


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_captured_step_matches_eager_step_on_cuda(backend):
    """compile_step on CUDA (inductor: CUDA graphs through mode="reduce-overhead"), with a
    step mask, clipping and isolation, against the eager phalanx step, member by member."""
    from phalanx.step._api import compile_step

    n = 4
    members = [m.cuda() for m in make_members(ARCHS[1], n)]
    lr = torch.tensor([1e-3, 1e-2, 3e-2, 1e-1], device="cuda")

    def build():
        stack = phalanx.stack(copy.deepcopy(members))
        return stack, phalanx.optim.Adam(stack.parameters(), lr=lr, skip_nonfinite=True)

    stack, opt = build()
    step = compile_step(
        stack, F.cross_entropy, opt, max_norm=1.0, backend=backend, prefer="captured",
        warmup_steps=1,
    )  # fmt: skip
    eager, eager_opt = build()
    torch.manual_seed(0)
    for k in range(6):
        x = torch.randn(16, 10, device="cuda")
        y = torch.randint(0, 2, (16,), device="cuda")
        mask = torch.tensor([True, k % 2 == 0, True, True], device="cuda")
        losses = step(x, y, mask=mask)
        eager_opt.zero_grad()
        expected = phalanx.member_losses(F.cross_entropy, eager(x), y)
        expected.sum().backward()
        phalanx.clip_grad_norm_(eager.parameters(), 1.0)
        eager_opt.step(mask=mask, loss=expected.detach())
        assert_close(losses, expected.detach(), trajectory=True, msg=f"losses of step {k}")
    assert step.choice == "captured" and step.compile_seconds is not None
    for (name, p), q in zip(stack.named_parameters(), eager.parameters()):
        for i in range(n):
            assert_close(p[i], q[i], msg=f"member {i} {name}", trajectory=True)


def test_bench_runs_on_cuda(tmp_path):
    from phalanx_tools.cli import main

    out = tmp_path / "bench.json"
    assert (
        main(["bench", "--quick", "--device", "cuda", "--workloads", "W2", "--json", str(out)]) == 0
    )
    assert out.exists()
