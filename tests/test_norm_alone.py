"""BatchNorm of large members, member by member (no copy of all members' activations): the
loop's bits, member by member."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import phalanx
from phalanx.backends.rules import _norm
from phalanx.testing import assert_equal_to_loop


def _conv2d() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())


def _conv1d() -> nn.Module:
    return nn.Sequential(nn.Conv1d(2, 3, 3), nn.BatchNorm1d(3), nn.Tanh(), nn.Flatten())


def _conv3d() -> nn.Module:
    return nn.Sequential(nn.Conv3d(1, 2, 2), nn.BatchNorm3d(2, momentum=0.3), nn.Flatten())


CASES = [(_conv2d, (5, 1, 9, 9)), (_conv1d, (6, 2, 11)), (_conv3d, (4, 1, 5, 5, 5))]


@pytest.mark.filterwarnings("ignore:.*input 0 is shared by every member:UserWarning")
@pytest.mark.parametrize("backend", ["fused", "vmap"])
@pytest.mark.parametrize("make, shape", CASES, ids=["2d", "1d", "3d"])
@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per-member"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batchnorm_of_large_members_gives_the_loops_bits(
    backend, make, shape, per_member, train, monkeypatch
):
    # member by member: the loop's own call (the one call over N * C channels is the loop's
    # to float rounding only, and a kept member's bits whatever N: test_member_checks)
    monkeypatch.setattr(_norm, "ALONE_BYTES", 0)
    torch.manual_seed(0)
    members = [make().train(train) for _ in range(3)]
    members_before = copy.deepcopy(members)
    x = torch.randn(3, *shape) if per_member else torch.randn(*shape)
    xs = x.clone().requires_grad_()
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    for _ in range(2):  # the second call reads the running statistics the first wrote
        out = stack(xs, in_dims=0 if per_member else None)
    params = list(stack.parameters())
    grads = torch.autograd.grad(out.square().sum(), [xs, *params], create_graph=True)
    second = torch.autograd.grad(sum(g.square().sum() for g in grads[1:]), params)
    seconds = {torch.float32: [], torch.float64: []}
    for i, m in enumerate(members):
        xi = (x[i] if per_member else x).clone().requires_grad_()
        for _ in range(2):
            ref = m(xi)
        own = torch.autograd.grad(ref.square().sum(), [xi, *m.parameters()], create_graph=True)
        assert torch.equal(out[i], ref), f"member {i}: output"
        if per_member:
            assert torch.equal(grads[0][i], own[0]), f"member {i}: input gradient"
        for (name, _), g, o in zip(stack.named_parameters(), grads[1:], own[1:]):
            assert torch.equal(g[i], o), f"member {i}: {name}.grad"
        for (name, b), c in zip(stack.named_buffers(), m.buffers()):
            assert torch.equal(b[i], c), f"member {i}: buffer {name}"
        for dtype in seconds:  # second derivatives: to float rounding (the conv's are)
            mm = copy.deepcopy(members_before[i]).to(dtype)
            xd = (x[i] if per_member else x).to(dtype).requires_grad_()
            for _ in range(2):
                r = mm(xd)
            gd = torch.autograd.grad(r.square().sum(), [xd, *mm.parameters()], create_graph=True)
            seconds[dtype].append(
                torch.autograd.grad(sum(g.square().sum() for g in gd[1:]), list(mm.parameters()))
            )
    for j, got in enumerate(second):
        assert_equal_to_loop(
            got,
            torch.stack([s[j] for s in seconds[torch.float32]]),
            torch.stack([s[j] for s in seconds[torch.float64]]),
            what=f"second derivative of parameter {j}",
            per_member=True,
        )


def test_large_members_take_the_member_by_member_path():
    calls = []
    original = _norm.per_member

    def counted(*args):
        calls.append(args[0])
        return original(*args)

    torch.manual_seed(0)
    stack = phalanx.stack([_conv2d() for _ in range(2)], backend="fused")
    x = torch.randn(64, 1, 34, 34)  # each member's BatchNorm input: 64 * 4 * 32 * 32 floats
    assert _norm.ALONE_BYTES <= 64 * 4 * 32 * 32 * 4
    _norm.per_member = counted
    try:
        stack(x)
        small = stack(x[:2])
    finally:
        _norm.per_member = original
    assert calls == [2], "the large input runs member by member, the small one in one call"
    assert small.shape == (2, 2, 4 * 32 * 32)
