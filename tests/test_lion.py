"""phalanx.optim.Lion: one rule in one file, against a hand-written loop over the members.

The reference runs each member alone, on its own tensors, with its hyperparameters as Python
numbers, one torch operation per line of Lion's update (the arithmetic Lion's docstring
promises). Each member must equal it bit for bit whatever N, masks and per-member values;
the captured step must equal the eager one to float rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from helpers import ARCHS, assert_close, make_members
from phalanx.step._api import compile_step


def lion_alone(p, g, m, *, lr, beta1, beta2, weight_decay, maximize) -> None:
    """One Lion step of one member, in place: the reference."""
    if maximize:
        g = -g
    p.mul_(1 - lr * weight_decay)
    c = torch.lerp(m, g, 1 - beta1)
    p.add_(c.sign(), alpha=-lr)
    m.lerp_(g, 1 - beta2)


CASES = {
    "defaults": {},
    "shared": {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1},
    "per_member": {
        "lr": [1e-2, 3e-3, 1e-1, 1e-3, 2e-2],
        "betas": ([0.9, 0.5, 0.8, 0.95, 0.0], 0.99),
        "weight_decay": [0.0, 0.1, 1.0, 0.01, 0.5],
        "maximize": [False, True, False, True, False],
    },
}


def _member(kwargs: dict, i: int) -> dict:
    def pick(v, default):
        if v is None:
            return default
        return v[i] if isinstance(v, list) else v

    betas = kwargs.get("betas", (0.9, 0.99))
    return {
        "lr": pick(kwargs.get("lr"), 1e-4),
        "beta1": pick(betas[0], 0.9),
        "beta2": pick(betas[1], 0.99),
        "weight_decay": pick(kwargs.get("weight_decay"), 0.0),
        "maximize": pick(kwargs.get("maximize"), False),
    }


def _ours(kwargs: dict, n: int) -> dict:
    def cut(v):
        if isinstance(v, list) and isinstance(v[0], bool):
            return torch.tensor(v[:n])
        return torch.tensor(v[:n], dtype=torch.float64) if isinstance(v, list) else v

    out = {k: cut(v) for k, v in kwargs.items() if k != "betas"}
    if "betas" in kwargs:
        out["betas"] = tuple(cut(b) for b in kwargs["betas"])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_member_equals_the_hand_written_loop_bit_for_bit(case, dtype) -> None:
    kwargs = CASES[case]
    shapes = [(16, 6), (16,), (3, 16), (7,)]
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(8, *s, generator=g, dtype=dtype) for s in shapes]
    for n in (1, 2, 5):
        params = [nn.Parameter(b[:n].clone()) for b in base]
        opt = phalanx.optim.Lion(params, **_ours(kwargs, n))
        refs = [[b[i].clone() for b in base] for i in range(n)]
        moms = [[torch.zeros_like(b[i]) for b in base] for i in range(n)]
        noise = torch.Generator().manual_seed(1)
        for t in range(8):
            z = [torch.randn(8, *s, generator=noise, dtype=dtype) for s in shapes]
            for p, zj in zip(params, z, strict=True):
                p.grad = 0.5 * p.detach() + zj[:n]
            mask = torch.arange(n) != t % n if t >= 4 else None
            opt.step(mask=mask)
            for i in range(n):
                if mask is not None and not mask[i]:
                    continue
                for r, m, zj in zip(refs[i], moms[i], z, strict=True):
                    lion_alone(r, 0.5 * r + zj[i], m, **_member(kwargs, i))
        for i in range(n):
            for j, (p, r) in enumerate(zip(params, refs[i], strict=True)):
                assert torch.equal(p[i], r), f"{case} N={n}: member {i} param {j}"
                assert torch.equal(opt.state[p]["exp_avg"][i], moms[i][j])


def test_large_blocked_tensors_equal_the_loop_bit_for_bit(monkeypatch) -> None:
    """Blocks split a member's rows and pack several members' rows: the same bits."""
    monkeypatch.setattr(phalanx.optim.Lion, "BLOCK", 64)
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 50, 7), (9, 5)]:  # 350 elements a member (> a block), and 5 (< one)
        p = nn.Parameter(torch.randn(*shape, generator=g))
        ref = [p[i].detach().clone() for i in range(shape[0])]
        mom = [torch.zeros_like(r) for r in ref]
        rates = torch.linspace(1e-3, 1e-1, shape[0], dtype=torch.float64)
        opt = phalanx.optim.Lion([p], lr=rates, weight_decay=0.1)
        for _ in range(3):
            z = torch.randn(*shape, generator=g)
            p.grad = z
            opt.step()
            for i in range(shape[0]):
                lion_alone(
                    ref[i], z[i], mom[i], lr=float(rates[i]), beta1=0.9, beta2=0.99, weight_decay=0.1,
                    maximize=False,
                )  # fmt: skip
        for i in range(shape[0]):
            assert torch.equal(p[i], ref[i]), f"{shape}: member {i}"


def test_bad_hyperparameters_are_named() -> None:
    w = nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"Lion\(\): betas\[1\] is 1.0 for every member"):
        phalanx.optim.Lion([w], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"Lion\(\): weight_decay is -1.0 for member 1"):
        phalanx.optim.Lion([w], weight_decay=torch.tensor([0.0, -1.0, 0.0]))


@pytest.mark.parametrize("opt_cls", ["Lion", "SGD", "Adagrad"])
def test_captured_step_equals_the_eager_step(opt_cls) -> None:
    """Any phalanx optimizer is captured: its own update is what the graph runs."""
    arch = next(a for a in ARCHS if a.name == "question2")
    members = make_members(arch, 4)
    lr = torch.tensor([1e-3, 1e-2, 3e-2, 1e-1], dtype=torch.float64)
    kwargs = {"lr": lr, "weight_decay": 0.01}
    if opt_cls == "SGD":
        kwargs |= {"momentum": 0.9, "nesterov": torch.tensor([True, False, True, False])}
    torch.manual_seed(3)
    data = [(torch.randn(8, 10), torch.randint(0, 2, (8,))) for _ in range(5)]
    results = []
    for captured in (True, False):
        stack = phalanx.stack(copy.deepcopy(members))
        opt = getattr(phalanx.optim, opt_cls)(stack.parameters(), **kwargs)
        if captured:
            step = compile_step(
                stack, F.cross_entropy, opt, backend="aot_eager", prefer="captured",
                warmup_steps=1,
            )  # fmt: skip
            for x, y in data:
                step(x, y)
            assert step.choice == "captured", step.report
        else:
            for x, y in data:
                opt.zero_grad()
                phalanx.member_losses(F.cross_entropy, stack(x), y).sum().backward()
                opt.step()
        results.append((stack.state_dict(), {k: dict(v) for k, v in opt.state.items()}))
    assert_close(results[0][0], results[1][0], trajectory=True, msg=f"{opt_cls} weights")
    for a, b in zip(results[0][1].values(), results[1][1].values(), strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert_close(a[k], b[k], trajectory=True, msg=f"{opt_cls} state {k}")
