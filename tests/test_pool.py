"""2-D max-pooling on the fused backend (rules/_pool.py: torch's kernel in the channels-last
layout): the loop's bits, member by member, forward, backward and second derivatives, on
ties, NaN and infinities, overlapping windows and every argument of the pool."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import phalanx
from phalanx.backends.rules import _norm, _pool

POOLS = {
    "2x2": {"kernel_size": 2},
    "overlapping": {"kernel_size": 3, "stride": 2, "padding": 1},
    "ceil": {"kernel_size": 2, "stride": 2, "ceil_mode": True},
    "dilated": {"kernel_size": (2, 3), "stride": (1, 2), "dilation": 2},
}


def _member(pool: dict) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(**pool), nn.Flatten()
    )


def _awkward(x: torch.Tensor, specials: bool = True) -> torch.Tensor:
    """Ties (values rounded to halves), and NaN and -inf/+inf in a few windows."""
    x = (x * 2).round() / 2
    if not specials:
        return x
    flat = x.view(-1)
    flat[::37] = float("nan")
    flat[5::41] = float("-inf")
    flat[11::53] = float("inf")
    return x


def _counted(monkeypatch) -> list[tuple]:
    calls: list[tuple] = []
    original = _pool._ChannelsLastMaxPool.apply

    def apply(x, *args):
        calls.append(tuple(x.shape))
        return original(x, *args)

    monkeypatch.setattr(_pool._ChannelsLastMaxPool, "apply", apply)
    return calls


class _Scaled(nn.Module):
    """A per-channel scale, then the pool: the pool's own first and second derivatives."""

    def __init__(self, pool: dict) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(2, 1, 1))
        self.pool = nn.MaxPool2d(**pool)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x * self.scale)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, NaN equal to NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


@pytest.mark.filterwarnings("ignore:.*input 0 is shared by every member:UserWarning")
@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per-member"])
@pytest.mark.parametrize("awkward", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("block", [_pool.BLOCK_BYTES, 1], ids=["one-block", "image-blocks"])
def test_max_pool_gives_the_loops_bits(pool, per_member, awkward, block, monkeypatch):
    # BatchNorm member by member (W7's size takes that path; the small members here would
    # take the one call, which is the loop's to rounding only)
    monkeypatch.setattr(_norm, "ALONE_BYTES", 0)
    monkeypatch.setattr(_pool, "BLOCK_BYTES", block)
    calls = _counted(monkeypatch)
    torch.manual_seed(0)
    members = [_member(pool) for _ in range(3)]
    if awkward:  # ties: rounded weights and inputs, zeros after the ReLU (NaN would fill
        # every output of a BatchNorm channel: test_second_derivatives_are_the_loops has them)
        with torch.no_grad():
            for m in members:
                m[0].weight.copy_((m[0].weight * 4).round() / 4)
                m[0].bias.zero_()
    x = torch.randn(3, 5, 2, 12, 11) if per_member else torch.randn(5, 2, 12, 11)
    x = _awkward(x, specials=False) if awkward else x
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    xs = x.clone().requires_grad_()
    for _ in range(2):  # the second call reads the running statistics the first wrote
        out = stack(xs, in_dims=0 if per_member else None)
    grads = torch.autograd.grad(out.nan_to_num(0).square().sum(), [xs, *stack.parameters()])
    assert calls, "the channels-last pool ran"
    for i, m in enumerate(members):
        xi = (x[i] if per_member else x).clone().requires_grad_()
        for _ in range(2):
            ref = m(xi)
        own = torch.autograd.grad(ref.nan_to_num(0).square().sum(), [xi, *m.parameters()])
        assert _same(out[i], ref), f"member {i}: output"
        if per_member:
            assert _same(grads[0][i], own[0]), f"member {i}: input gradient"
        for (name, _), g, o in zip(stack.named_parameters(), grads[1:], own[1:]):
            assert _same(g[i], o), f"member {i}: {name}.grad"


@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
@pytest.mark.parametrize("awkward", [False, True], ids=["random", "ties-nan-inf"])
@pytest.mark.parametrize("block", [_pool.BLOCK_BYTES, 5300], ids=["one-block", "blocks"])
def test_second_derivatives_are_the_loops(pool, awkward, block, monkeypatch):
    # 5300 bytes: the 12 images of 1056 bytes in blocks of 5, 5 and 2
    monkeypatch.setattr(_pool, "BLOCK_BYTES", block)
    calls = _counted(monkeypatch)
    torch.manual_seed(1)
    members = [_Scaled(pool) for _ in range(3)]
    x = torch.randn(3, 4, 2, 12, 11)
    x = _awkward(x) if awkward else x
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    xs = x.clone().requires_grad_()
    out = stack(xs, in_dims=0)
    params = list(stack.parameters())
    first = torch.autograd.grad(out.nan_to_num(0).pow(3).sum(), [xs, *params], create_graph=True)
    second = torch.autograd.grad(sum(g.nan_to_num(0).square().sum() for g in first), [xs, *params])
    assert calls
    for i, m in enumerate(members):
        xi = x[i].clone().requires_grad_()
        ref = m(xi)
        own = torch.autograd.grad(
            ref.nan_to_num(0).pow(3).sum(), [xi, *m.parameters()], create_graph=True
        )
        sec = torch.autograd.grad(sum(g.nan_to_num(0).square().sum() for g in own), [xi, m.scale])
        assert _same(out[i], ref), f"member {i}: output"
        for what, g, o in zip(("input", "scale"), first, own):
            assert _same(g[i], o), f"member {i}: gradient of the {what}"
        for what, g, o in zip(("input", "scale"), second, sec):
            assert _same(g[i], o), f"member {i}: second derivative of the {what}"


@pytest.mark.parametrize(
    "case", ["channels_last_input", "unbatched_member_input", "return_indices", "no_grad"]
)
def test_other_inputs_keep_the_loops_answer(case, monkeypatch):
    calls = _counted(monkeypatch)
    torch.manual_seed(2)

    class Pool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.randn(3, 1, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * self.scale
            if case == "return_indices":
                v, idx = nn.functional.max_pool2d(h, 2, return_indices=True)
                return v + idx.to(v.dtype)
            return nn.functional.max_pool2d(h, 3, stride=2, padding=1)

    members = [Pool() for _ in range(2)]
    x = torch.randn(2, 4, 3, 9, 9)
    if case == "channels_last_input":
        x = torch.randn(2, 4, 9, 9, 3).permute(0, 1, 4, 2, 3)  # each member channels-last
    if case == "unbatched_member_input":
        x = x[:, 0]  # a member's input (C, H, W)
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    with torch.set_grad_enabled(case != "no_grad"):
        out = stack(x, in_dims=0)
    for i, m in enumerate(members):
        with torch.set_grad_enabled(case != "no_grad"):
            ref = m(x[i])
        assert torch.equal(out[i], ref), f"member {i}"
        assert out[i].is_contiguous() == ref.is_contiguous()
    taken = case in ("unbatched_member_input", "no_grad")
    assert bool(calls) == taken, f"channels-last path taken: {bool(calls)}"
