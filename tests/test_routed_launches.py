"""A routed call with a few segments runs the loop's own work: per input one gather of the
rows, per output one copy into place (not one per segment), values equal to the loop's bit
for bit. Counted with a dispatch mode (operations, not time)."""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import phalanx

N, S, A, ROWS = 5, 6, 2, 40


class Dyn(nn.Module):
    """A PETS-style member: two inputs, two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(S + A, 16), nn.SiLU(), nn.Linear(16, 2 * S))
        self.max_logvar = nn.Parameter(torch.full((S,), 0.5))

    def forward(self, o: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, logvar = self.net(torch.cat([o, a], -1)).chunk(2, -1)
        return mean, self.max_logvar - F.softplus(self.max_logvar - logvar)


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _setup() -> tuple[phalanx.Stack, list[nn.Module], torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    models = [Dyn() for _ in range(N)]
    stack = phalanx.stack(models)
    o, a = torch.randn(ROWS, S), torch.randn(ROWS, A)
    member = torch.randint(0, N, (ROWS,))
    member[:N] = torch.arange(N)  # every member has rows, out of order
    return stack, models, o, a, member


def _loop(models: list[nn.Module], o, a, member) -> tuple[torch.Tensor, torch.Tensor]:
    mean, logvar = torch.empty(ROWS, S), torch.empty(ROWS, S)
    for i, m in enumerate(models):
        rows = (member == i).nonzero().squeeze(1)
        mean[rows], logvar[rows] = m(o[rows], a[rows])
    return mean, logvar


def test_few_segments_put_back_once_per_output_and_gather_once_per_input():
    stack, models, o, a, member = _setup()
    with torch.no_grad():
        stack(o, a, members=member)  # proves the trace, builds the member function
        with Ops() as ops:
            mean, logvar = stack(o, a, members=member)
        ref = _loop(models, o, a, member)
    assert stack.routed_path == "segment"
    assert ops.seen["index_copy_"] + ops.seen["index_copy"] == 2, ops.seen  # one per output
    assert ops.seen["index_select"] == 2, ops.seen  # one per input: the index's sort is kept
    assert torch.equal(mean, ref[0]) and torch.equal(logvar, ref[1])


def test_few_segments_train_matches_the_loop():
    stack, models, o, a, member = _setup()
    o.requires_grad_(True)
    mean, logvar = stack(o, a, members=member)
    (mean.square().sum() + logvar.sum()).backward()
    o2 = o.detach().clone().requires_grad_(True)
    ref = _loop(models, o2, a, member)
    (ref[0].square().sum() + ref[1].sum()).backward()
    assert torch.allclose(mean, ref[0]) and torch.allclose(logvar, ref[1])
    assert torch.allclose(o.grad, o2.grad, atol=1e-6)
    grads = dict(stack.named_parameters())
    for name, _ in models[0].named_parameters():
        stacked = grads["module." + name].grad
        assert stacked is not None
        for i, m in enumerate(models):
            assert torch.allclose(stacked[i], dict(m.named_parameters())[name].grad, atol=1e-6)
