"""phalanx.optim.LBFGS: each member is torch.optim.LBFGS on that member alone, bit for bit.

The closure below computes each member's loss from its own row with the same operations
torch sees for the member alone, so losses and gradients are bit-identical and any
difference would be the optimizer's. The members' problems differ in conditioning, so their
line searches take different numbers of evaluations and they stop at different iterations:
one history and one line search for all (torch's LBFGS over the stack) could not match.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import phalanx

N, D = 4, 6
SCALES = torch.tensor([1.0, 10.0, 0.1, 3.0], dtype=torch.float64)


def _loss(w: torch.Tensor, i: int, shift: float = 0.0) -> torch.Tensor:
    """A member's loss: an ill-conditioned Rosenbrock-like function, member i's own scale."""
    a = SCALES[i] * (w[1:] - w[:-1] ** 2) ** 2
    return a.sum() + ((1 + shift - w) ** 2).sum() + 0.1 * (w**4).sum()


def _start() -> torch.Tensor:
    return torch.randn(N, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.mark.parametrize("line_search_fn", [None, "strong_wolfe"])
def test_each_member_is_torch_lbfgs_alone_bit_for_bit(line_search_fn):
    kwargs = {"max_iter": 15, "history_size": 5, "line_search_fn": line_search_fn}
    lrs = [1.0, 0.5, 1.0, 0.25]
    w = nn.Parameter(_start())
    opt = phalanx.optim.LBFGS([w], lr=lrs, **kwargs)

    def closure():
        opt.zero_grad()
        losses = torch.stack([_loss(w[i], i) for i in range(N)])
        losses.sum().backward()
        return losses

    alone = []
    for i in range(N):
        r = nn.Parameter(_start()[i])
        o = torch.optim.LBFGS([r], lr=lrs[i], **kwargs)

        def member_closure(r=r, o=o, i=i):
            o.zero_grad()
            loss = _loss(r, i)
            loss.backward()
            return loss

        for _ in range(2):
            o.step(member_closure)
        alone.append((r, o))
    for _ in range(2):
        opt.step(closure)
    evals = set()
    for i, (r, o) in enumerate(alone):
        assert torch.equal(w[i], r), f"member {i}"
        mine, theirs = opt.members[i].state[opt.leaves[i][0]], o.state[r]
        assert mine["func_evals"] == theirs["func_evals"] and mine["n_iter"] == theirs["n_iter"]
        evals.add(theirs["func_evals"])
    assert len(evals) > 1, "every member took the same path: the test would not see coupling"


def test_changing_one_members_problem_leaves_the_others_bit_identical():
    finals = []
    for shift in (0.0, 5.0):
        w = nn.Parameter(_start())
        opt = phalanx.optim.LBFGS([w], line_search_fn="strong_wolfe", max_iter=10)

        def closure(w=w, opt=opt, shift=shift):
            opt.zero_grad()
            losses = torch.stack([_loss(w[i], i, shift if i == 0 else 0.0) for i in range(N)])
            losses.sum().backward()
            return losses

        opt.step(closure)
        finals.append(w.detach().clone())
    assert not torch.equal(finals[0][0], finals[1][0])
    assert torch.equal(finals[0][1:], finals[1][1:])


def test_the_closure_must_return_per_member_losses_and_its_errors_reach_the_caller():
    w = nn.Parameter(_start())
    opt = phalanx.optim.LBFGS([w])
    threads = threading.active_count()  # others' (inductor's compile workers) included

    def summed():
        opt.zero_grad()
        loss = sum(_loss(w[i], i) for i in range(N))
        loss.backward()
        return loss

    with pytest.raises(ValueError, match=r"LBFGS.step\(\): the closure must return the \(4,\) per"):
        opt.step(summed)

    def failing():
        raise RuntimeError("out of memory, say")

    with pytest.raises(RuntimeError, match="out of memory, say"):
        opt.step(failing)
    assert threading.active_count() <= threads  # no member thread left waiting
    with pytest.raises(ValueError, match=r"lr must be a number or one per member \(4\)"):
        phalanx.optim.LBFGS([w], lr=[1.0, 2.0])


def test_a_stack_trains_with_member_lbfgs_like_each_model_alone():
    """The whole path: a stack on the loop backend (bit-exact per member), Adam's successor."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).double() for _ in range(3)]
    x = torch.randn(16, 2, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True))
    stack = phalanx.stack([m for m in models], backend="loop")
    opt = phalanx.optim.LBFGS(stack.parameters(), line_search_fn="strong_wolfe", max_iter=8)

    def closure():
        opt.zero_grad()
        out = stack(x)  # (N, B, 1)
        losses = ((out - y) ** 2).mean(dim=(1, 2))
        losses.sum().backward()
        return losses

    opt.step(closure)
    for i, m in enumerate(models):
        alone = torch.optim.LBFGS(m.parameters(), line_search_fn="strong_wolfe", max_iter=8)

        def member_closure(m=m, alone=alone):
            alone.zero_grad()
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            return loss

        alone.step(member_closure)
        mine = [p[i] for p in stack.parameters()]
        torch.testing.assert_close(mine, list(m.parameters()), rtol=1e-9, atol=1e-12)


def test_state_round_trips_through_torch_save_and_phalanx_save_refuses_it(tmp_path):
    def run(opt, w):
        def closure():
            opt.zero_grad()
            losses = torch.stack([_loss(w[i], i) for i in range(N)])
            losses.sum().backward()
            return losses

        opt.step(closure)

    w, v = nn.Parameter(_start()), nn.Parameter(_start())
    opt = phalanx.optim.LBFGS([w], max_iter=3, history_size=4)
    run(opt, w)
    torch.save(opt.state_dict(), tmp_path / "lbfgs.pt")
    with torch.no_grad():
        v.copy_(w)
    resumed = phalanx.optim.LBFGS([v], max_iter=3, history_size=4)
    resumed.load_state_dict(torch.load(tmp_path / "lbfgs.pt"))
    run(opt, w)
    run(resumed, v)
    assert torch.equal(w, v)
    stack = phalanx.stack([nn.Linear(2, 1) for _ in range(N)], backend="loop")
    with pytest.raises(TypeError, match=r"phalanx.save\(\): phalanx.optim.LBFGS keeps one history"):
        phalanx.save(tmp_path / "run.safetensors", stack, optimizer=opt)
