"""Per-member clipping against torch.nn.utils applied to each member's parameters alone."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import phalanx

N = 5
SHAPES = [(4, 3), (4,), ()]


def make(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(N, *s, generator=g, dtype=dtype)) for s in SHAPES]
    scale = torch.tensor([0.01, 0.1, 1.0, 10.0, 1000.0], dtype=dtype)  # norms on both sides
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=dtype) * scale.view(
            -1, *[1] * (p.dim() - 1)
        )
    return params


def members(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Each member's parameters alone, gradients copied."""
    out = []
    for i in range(N):
        ps = []
        for p in params:
            q = nn.Parameter(p[i].detach().clone())
            q.grad = p.grad[i].clone()
            ps.append(q)
        out.append(ps)
    return out


TOL = {torch.float32: {"rtol": 1e-6, "atol": 1e-7}, torch.float64: {"rtol": 1e-14, "atol": 1e-15}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("per_member_max", [False, True], ids=["float_max", "member_max"])
def test_clip_grad_norm_matches_torch_per_member(
    dtype: torch.dtype, norm_type: float, per_member_max: bool
) -> None:
    params = make(dtype)
    refs = members(params)
    max_norm = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0]) if per_member_max else 1.0
    norms = phalanx.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    assert norms.shape == (N,)
    for i, ref in enumerate(refs):
        m = float(max_norm[i]) if per_member_max else max_norm
        expected = torch.nn.utils.clip_grad_norm_(ref, m, norm_type=norm_type)
        # a per-member reduction sums in another order than torch's whole-tensor norm
        torch.testing.assert_close(norms[i], expected, **TOL[dtype])
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p.grad[i], r.grad, **TOL[dtype], msg=f"member {i}")
    # members both below and above the limit were present
    limit = torch.as_tensor(max_norm, dtype=dtype)
    assert bool((norms < limit).any()) and bool((norms > limit).any())


def test_one_exploding_member_does_not_shrink_the_others() -> None:
    params = make()
    before = [p.grad.clone() for p in params]
    params[0].grad[3] = float("inf")
    norms = phalanx.clip_grad_norm_(params, max_norm=1e9)
    assert math.isinf(norms[3])
    for p, b in zip(params, before, strict=True):
        keep = torch.arange(N) != 3
        assert torch.equal(p.grad[keep], b[keep])  # limit far above: untouched


def test_error_if_nonfinite_names_the_members() -> None:
    params = make()
    params[1].grad[2, 0] = float("nan")
    with pytest.raises(
        RuntimeError, match=r"clip_grad_norm_\(\): the gradient norm of members \[2\] is not finite"
    ):
        phalanx.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def test_clip_grad_value_matches_torch_per_member() -> None:
    params = make()
    refs = members(params)
    clip = torch.tensor([0.001, 0.01, 0.1, 1.0, 10.0])
    phalanx.clip_grad_value_(params, clip)
    for i, ref in enumerate(refs):
        torch.nn.utils.clip_grad_value_(ref, float(clip[i]))
        for p, r in zip(params, ref, strict=True):
            assert torch.equal(p.grad[i], r.grad)
    assert float(params[0].grad[0].abs().max()) == pytest.approx(0.001)
    phalanx.clip_grad_value_(params, 0.0005)
    assert float(params[0].grad.abs().max()) == pytest.approx(0.0005)


def test_clip_on_stack_parameters_and_errors() -> None:
    stack = phalanx.stack([nn.Linear(3, 2) for _ in range(4)])
    stack(torch.randn(8, 3)).pow(2).sum().backward()
    norms = phalanx.clip_grad_norm_(stack.parameters(), max_norm=torch.full((4,), 0.1))
    assert norms.shape == (4,)
    after = torch.stack(
        [
            torch.linalg.vector_norm(torch.cat([p.grad[i].flatten() for p in stack.parameters()]))
            for i in range(4)
        ]
    )
    torch.testing.assert_close(after, torch.minimum(norms, torch.tensor(0.1)), rtol=1e-4, atol=1e-6)
    with pytest.raises(
        ValueError,
        match=r"clip_grad_norm_\(\): max_norm has shape \(3,\); expected a number or a tensor of shape \(4,\)",
    ):
        phalanx.clip_grad_norm_(stack.parameters(), max_norm=torch.ones(3))
    with pytest.raises(
        ValueError,
        match=r"clip_grad_value_\(\): parameter 1 has shape \(3, 2\), expected \(N, \*shape\) with N = 4",
    ):
        phalanx.clip_grad_value_(
            [nn.Parameter(torch.zeros(4, 2)), nn.Parameter(torch.zeros(3, 2))], 1.0
        )


# -------------------------------------- torch's clip_grad_norm_ on a stack: made loud by a check


def _training_step(optimizer: str, clip):
    """A stack with dropout and BatchNorm, its optimizer and one step that clips with ``clip``."""
    torch.manual_seed(0)
    stack = phalanx.stack(
        [nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.Linear(8, 2))
         for _ in range(3)]
    )  # fmt: skip
    opt = getattr(phalanx.optim, optimizer)(stack.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randn(16, 2)

    def step() -> None:
        opt.zero_grad()
        phalanx.member_losses(torch.nn.functional.mse_loss, stack(x), y).sum().backward()
        clip(stack.parameters(), max_norm=1.0)
        opt.step()

    return stack, opt, step


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_coupling_check_catches_torchs_joint_clip(optimizer: str) -> None:
    """torch.nn.utils.clip_grad_norm_ on a stack cannot be detected when it runs (it reads
    plain gradient tensors): phalanx.testing's check shows it, naming the fix; phalanx's own
    clipping passes, and the check leaves weights and optimizer state as they were."""
    stack, opt, step = _training_step(optimizer, torch.nn.utils.clip_grad_norm_)
    before = {k: v.clone() for k, v in stack.state_dict().items()}
    with pytest.raises(AssertionError, match=r"member 1 parameter .*phalanx.clip_grad_norm_"):
        phalanx.testing.assert_members_independent(stack, step, opt)
    for k, v in stack.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not opt.state_dict()["state"]
    stack, opt, step = _training_step(optimizer, phalanx.clip_grad_norm_)
    phalanx.testing.assert_members_independent(stack, step, opt)
    phalanx.testing.assert_members_independent(stack, step, opt, member=2)
