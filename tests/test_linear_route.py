"""Which path ``F.linear`` takes on ``fused``, and that each is the loop's answer.

A per-member input with a small weight (``rules._linear.SMALL_WEIGHT``) runs torch.func's own
batching of ``F.linear``; a shared input, or a larger weight, runs phalanx's rule. Each is
compared with the members run one by one, member by member, against a float64 loop
(``phalanx.testing``): outputs, input and parameter gradients, and second derivatives.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import phalanx
from phalanx.backends.rules import _linear
from phalanx.testing import assert_equal_to_loop


class TwoLayers(nn.Module):
    """Not a plain Sequential (which the MLP fast path would take): every Linear is routed."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(6, width)
        self.b = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


N, B = 3, 4


def _inputs(mode: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    shape = (N, B, 5, 6) if mode == "per_member" else (B, 5, 6)
    return torch.randn(shape, generator=g).to(dtype)


def _loss_and_penalty(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The output's squares plus, for an input of the member's own, the input gradient's (a
    gradient penalty: second derivatives flow through every Linear). A shared input's
    gradient is the sum over the members, which no member alone computes: no penalty."""
    if not x.requires_grad:
        return out.square().sum()
    (g,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    return out.square().sum() + g.square().sum()


def _loop(members: list[nn.Module], x: torch.Tensor, mode: str):
    """Outputs and parameter gradients of the members run one by one."""
    outs, grads = [], []
    for i, m in enumerate(members):
        xi = (x[i] if mode == "per_member" else x).clone().requires_grad_(mode == "per_member")
        out = m(xi)
        params = list(m.parameters())
        grads.append(torch.autograd.grad(_loss_and_penalty(out, xi), params))
        outs.append(out.detach())
    return torch.stack(outs), [torch.stack(g) for g in zip(*grads)]


@pytest.fixture
def rule_calls(monkeypatch) -> list[int]:
    """One entry per ``F.linear`` call that runs phalanx's rule (not torch.func's batching)."""
    calls: list[int] = []
    route = _linear._by_rule
    monkeypatch.setattr(
        _linear, "_by_rule", lambda args, kwargs: calls.append(1) or route(args, kwargs)
    )
    return calls


@pytest.mark.parametrize(
    ("width", "mode", "by_rule"),
    [
        (8, "per_member", False),  # 48- and 24-element weights: torch.func's own batching
        (8, "shared", True),  # one GEMM against every member's weights
        (6000, "per_member", True),  # a 36000-element weight: over SMALL_WEIGHT
    ],
    ids=["small-per-member", "small-shared", "large-per-member"],
)
def test_linear_path_and_its_result_equal_the_loop(width, mode, by_rule, rule_calls):
    assert (6 * width > _linear.SMALL_WEIGHT) == (width == 6000)
    torch.manual_seed(0)
    members = [TwoLayers(width) for _ in range(N)]
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    x = _inputs(mode, torch.float32).requires_grad_(mode == "per_member")
    out = stack(x, in_dims=0 if mode == "per_member" else None)
    params = list(stack.parameters())
    got_grads = torch.autograd.grad(_loss_and_penalty(out, x), params)
    assert bool(rule_calls) == by_rule, f"rule called {len(rule_calls)} times"

    loop_out, loop_grads = _loop(members, _inputs(mode, torch.float32), mode)
    ref_out, ref_grads = _loop(
        [copy.deepcopy(m).double() for m in members], _inputs(mode, torch.float64), mode
    )
    assert_equal_to_loop(out, loop_out, ref_out, what="outputs", per_member=True)
    names = [n for n, _ in stack.module.named_parameters()]
    for name, g, lg, rg in zip(names, got_grads, loop_grads, ref_grads):
        assert_equal_to_loop(g, lg, rg, what=f"gradient of {name}", per_member=True)


def test_linear_under_autocast_keeps_the_rule(rule_calls):
    """torch.func computes in float32 under CPU autocast, the member alone in bfloat16."""
    torch.manual_seed(0)
    members = [TwoLayers(8) for _ in range(N)]
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    x = _inputs("per_member", torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = stack(x, in_dims=0)
        expected = torch.stack([m(x[i]) for i, m in enumerate(members)])
    assert rule_calls
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_a_trace_keeps_the_rule(rule_calls):
    """compile_step's trace takes the rule for a small per-member Linear too: its compiled
    graph runs faster than torch.func's (benchmarks/notes/TRAIN_STEP.md, issue 26's fourth session)."""
    torch.manual_seed(0)
    stack = phalanx.stack([TwoLayers(8) for _ in range(N)], backend="fused")
    opt = phalanx.optim.Adam(stack.parameters())
    step = phalanx.compile_step(
        stack, lambda out, y: (out - y).square().mean(), opt, in_dims=0, target_in_dims=0,
        backend="aot_eager", prefer="captured", warmup_steps=1,
    )  # fmt: skip
    x, y = _inputs("per_member", torch.float32), torch.zeros(N, B, 5, 3)
    step(x, y)  # the warm-up: an eager step, torch.func's batching
    assert not rule_calls
    step(x, y)  # traced and captured
    assert step.choice == "captured" and rule_calls
