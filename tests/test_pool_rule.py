"""Max pooling's rule (indices recomputed in the backward) and BatchNorm member by member:
the loop's bits, member by member."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.backends.rules import _norm


class Pool(nn.Module):
    def __init__(self, k: int, **options) -> None:
        super().__init__()
        self.k, self.options = k, options
        self.conv = (nn.Conv2d if k == 2 else nn.Conv3d)(2, 3, 3, padding=1)

    def forward(self, x):
        pool = F.max_pool2d if self.k == 2 else F.max_pool3d
        return pool(self.conv(x).relu(), **self.options).tanh()


OPTIONS = [
    {"kernel_size": 2},
    {"kernel_size": 3, "stride": 2, "padding": 1},
    {"kernel_size": 2, "stride": 1, "dilation": 2},
    {"kernel_size": 3, "stride": 2, "ceil_mode": True},
    {"kernel_size": (2, 3), "stride": (1, 2)},
]


def _loop(members, x, per_member, create_graph=False):
    outs, grads = [], []
    for i, m in enumerate(members):
        xi = (x[i] if per_member else x).detach().requires_grad_()
        y = m(xi)
        loss = y.square().sum()
        got = torch.autograd.grad(loss, [xi, *m.parameters()], create_graph=create_graph)
        if create_graph:
            got = torch.autograd.grad(sum(g.square().sum() for g in got), [xi, *m.parameters()])
        outs.append(y.detach())
        grads.append(got)
    return outs, grads


pytestmark = pytest.mark.filterwarnings("ignore:.*input 0 is shared by every member:UserWarning")


def _stacked(members, x, per_member, backend, create_graph=False):
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    xs = x.detach().requires_grad_()
    y = stack(xs, in_dims=0 if per_member else None)
    params = list(stack.parameters())
    got = torch.autograd.grad(y.square().sum(), [xs, *params], create_graph=create_graph)
    if create_graph:
        got = torch.autograd.grad(sum(g.square().sum() for g in got), [xs, *params])
    return y.detach(), got


def _shape(k, per_member, batch=4):
    spatial = (7, 8) if k == 2 else (5, 6, 5)
    return ((3,) if per_member else ()) + (batch, 2, *spatial)


@pytest.mark.parametrize("backend", ["fused", "vmap"])
@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per-member"])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items())
)
def test_max_pool_gives_the_loops_bits(backend, per_member, k, options):
    if k == 3:
        options = {key: (v[:1] * 3 if isinstance(v, tuple) else v) for key, v in options.items()}
    torch.manual_seed(0)
    members = [Pool(k, **options) for _ in range(3)]
    # integers make ties in most windows: the tie-breaking is the loop's too
    x = torch.randint(-2, 3, _shape(k, per_member)).float()
    outs, grads = _loop(members, x, per_member)
    y, got = _stacked(members, x, per_member, backend)
    for i in range(3):
        assert torch.equal(y[i], outs[i]), f"member {i}: output"
        gx = got[0][i] if per_member else None
        if per_member:
            assert torch.equal(gx, grads[i][0]), f"member {i}: input gradient"
        for j, (a, b) in enumerate(zip(got[1:], grads[i][1:])):
            assert torch.equal(a[i], b), f"member {i}: parameter {j}"
    if not per_member:  # the shared input's gradient sums the members' (order: float rounding)
        total = sum(g[0] for g in grads)
        torch.testing.assert_close(got[0], total)


@pytest.mark.parametrize("backend", ["fused", "vmap"])
def test_max_pool_second_derivatives_are_the_loops(backend):
    torch.manual_seed(0)
    members = [Pool(2, kernel_size=2) for _ in range(3)]
    x = torch.randn(_shape(2, True))
    _, grads = _loop(members, x, True, create_graph=True)
    _, got = _stacked(members, x, True, backend, create_graph=True)
    for i in range(3):
        torch.testing.assert_close(got[0][i], grads[i][0], rtol=1e-5, atol=1e-6)
        for a, b in zip(got[1:], grads[i][1:]):
            torch.testing.assert_close(a[i], b, rtol=1e-5, atol=1e-6)


def test_max_pool_keeps_no_indices_for_the_backward():
    torch.manual_seed(0)
    stack = phalanx.stack([nn.Sequential(nn.ReLU(), nn.MaxPool2d(2)) for _ in range(3)])
    x = torch.randn(3, 4, 2, 8, 8, requires_grad=True)
    y = stack(x, in_dims=0)
    saved, seen, todo = [], set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            if name.startswith("_saved_"):
                saved.append(getattr(fn, name))
        saved.extend(getattr(fn, "saved_tensors", ()))
        todo.extend(f for f, _ in fn.next_functions)
    assert not [t for t in saved if isinstance(t, torch.Tensor) and t.dtype == torch.int64]


@pytest.mark.parametrize("backend", ["fused", "vmap"])
def test_max_pool_returning_indices_or_channels_last_is_the_loops(backend):
    torch.manual_seed(0)
    pools = [nn.MaxPool2d(2, return_indices=True) for _ in range(3)]
    x = torch.randn(3, 4, 2, 8, 8)
    y, idx = phalanx.stack(pools, backend=backend)(x, in_dims=0)
    for i in range(3):
        ref, ref_idx = F.max_pool2d(x[i], 2, return_indices=True)
        assert torch.equal(y[i], ref) and torch.equal(idx[i], ref_idx)
    members = [Pool(2, kernel_size=2).to(memory_format=torch.channels_last) for _ in range(3)]
    xc = torch.randn(4, 2, 7, 8).to(memory_format=torch.channels_last)
    outs, grads = _loop(members, xc, False)
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    stack.to(memory_format=torch.channels_last)
    out = stack(xc)
    out.square().sum().backward()
    for i in range(len(members)):
        assert torch.equal(out[i], outs[i])
        for p, g in zip(stack.parameters(), grads[i][1:]):
            torch.testing.assert_close(p.grad[i], g)


@pytest.mark.parametrize("backend", ["fused", "vmap"])
def test_batchnorm_of_large_members_gives_the_loops_bits(backend, monkeypatch):
    # member by member: the loop's own call (the one call over N * C channels is the loop's
    # to float rounding only, and a kept member's bits whatever N: test_member_checks)
    monkeypatch.setattr(_norm, "ALONE_BYTES", 0)
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
        for _ in range(3)
    ]
    x = torch.randn(5, 1, 9, 9)
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    for _ in range(2):  # the second call reads the running statistics the first wrote
        out = stack(x)
    out.square().sum().backward()
    for i, m in enumerate(members):
        for _ in range(2):
            ref = m(x)
        ref.square().sum().backward()
        assert torch.equal(out[i], ref), f"member {i}: output"
        for (name, p), q in zip(stack.named_parameters(), m.parameters()):
            assert torch.equal(p.grad[i], q.grad), f"member {i}: {name}.grad"
        for b, c in zip(stack.buffers(), m.buffers()):
            assert torch.equal(b[i], c), f"member {i}: running statistics"
