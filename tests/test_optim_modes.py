"""What each optimizer mode promises, member by member.

- "fast" (the default): every member equal to float rounding of the float64 update (no
  further from torch.optim in float64 on that member alone than torch.optim in float32 is, by
  a small factor), with per-member hyperparameters, masks and skip_nonfinite. Where members
  share every hyperparameter and their step counts, it is one call of torch's fused kernel on
  the whole stacked tensors: bit for bit ``torch.optim.X(fused=True)`` on the stacked tensors.
- "torch": torch.optim's single-tensor arithmetic on member i alone, bit for bit
  (tests/test_optim.py, tests/test_optim_inplace.py).
- "fused": torch.optim's fused=True on member i alone, bit for bit (tests/test_optim.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import phalanx

N = 5
SHAPES = [(6, 7), (7,), (3, 1, 5)]
STEPS = 12
RATES = torch.tensor([1e-2, 3e-3, 2e-2, 5e-3, 1e-2], dtype=torch.float64)


class KernelSpy(TorchDispatchMode):
    """Counts calls of torch's fused optimizer kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func).startswith(("aten._fused_adam", "aten._fused_sgd")):
            self.calls += 1
        return func(*args, **(kwargs or {}))


CASES = [
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1}, False),
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1, "maximize": True}, True),
    ("Adam", {"lr": 1e-2, "amsgrad": True}, True),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}, True),
    ("SGD", {"lr": 1e-2, "momentum": 0.9, "dampening": 0.1}, False),
    ("SGD", {"lr": 1e-2, "momentum": 0.9, "nesterov": True}, True),
    ("SGD", {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1, "maximize": True}, True),
    ("SGD", {"lr": 1e-2, "weight_decay": 0.1}, True),
]

# Per-member values besides lr: torch's kernel cannot take them in one call on the stacked
# tensors. Large members step on their views (``_blocked.member_views``), small ones on the
# blocked arithmetic.
PER_MEMBER = [
    ("Adam", {"lr": 1e-2, "betas": ([0.9, 0.8, 0.95, 0.9, 0.85], 0.999), "eps": 1e-6}),
    ("AdamW", {"lr": 1e-2, "weight_decay": [0.0, 0.1, 0.2, 0.1, 0.05], "amsgrad": True}),
    ("Adam", {"lr": 1e-2, "eps": [1e-8, 1e-6, 1e-4, 1e-8, 1e-3], "maximize": [True] + [False] * 4}),
    ("SGD", {"lr": 1e-2, "momentum": [0.9, 0.5, 0.0, 0.9, 0.8], "weight_decay": 0.1}),
    ("SGD", {"lr": 1e-2, "momentum": 0.9, "nesterov": [True, False, True, True, False]}),
    ("Lion", {"lr": 1e-3, "betas": ([0.9, 0.8, 0.95, 0.9, 0.85], 0.99), "weight_decay": 0.1}),
]


def _grads(t: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return [torch.randn(N, *s, generator=g, dtype=torch.float64).to(dtype) for s in SHAPES]


def _member(kwargs: dict, i: int) -> dict:
    """Member i's values of per-member kwargs (lists), as torch.optim takes them."""

    def one(v):  # type: ignore[no-untyped-def]
        if isinstance(v, tuple):
            return tuple(one(x) for x in v)
        return v[i] if isinstance(v, list) else v

    return {k: one(v) for k, v in kwargs.items()}


class _Lion(torch.optim.Optimizer):
    """Lion as phalanx documents it, one member alone (torch has none)."""

    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0):  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.lerp(m, p.grad, 1 - b1).sign(), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - b2)


def _torch_optimizer(cls: str, params: list, kwargs: dict):  # type: ignore[no-untyped-def]
    return _Lion(params, **kwargs) if cls == "Lion" else getattr(torch.optim, cls)(params, **kwargs)


def _check_float_rounding(
    cls: str, kwargs: dict, rates: list[float] | None, how: str, *, schedule: bool = False
) -> None:
    """Runs phalanx's default mode and the per-member loop of torch.optim in float32 and
    float64 for STEPS steps (some members left out of some steps by ``how``: "mask" or
    "nonfinite"; a state_dict round trip half way; with ``schedule``, a StepLR on both), and
    asserts every member is no further from float64 than the float32 loop, by a small factor.
    """
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(N, *s, generator=g, dtype=torch.float64) for s in SHAPES]
    params = [nn.Parameter(b.float()) for b in base]
    ours = {**kwargs, "lr": torch.tensor(rates, dtype=torch.float64)} if rates else kwargs
    extra = {"skip_nonfinite": True} if how == "nonfinite" else {}
    cls_ = getattr(phalanx.optim, cls)
    opt = cls_(params, **ours, **extra)
    lrs = rates or [kwargs["lr"]] * N

    def left_out(t: int, i: int) -> bool:
        return how != "all" and t % 4 == 1 and i == t % N

    def scheduled(o):  # type: ignore[no-untyped-def]
        return torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) if schedule else None

    def loop(dtype: torch.dtype) -> list[list[nn.Parameter]]:
        refs = [[nn.Parameter(b[i].to(dtype, copy=True)) for b in base] for i in range(N)]
        opts = [
            _torch_optimizer(cls, r, {**_member(kwargs, i), "lr": lrs[i]})
            for i, r in enumerate(refs)
        ]
        scheds = [scheduled(o) for o in opts]
        for t in range(STEPS):
            for i in range(N):
                if not left_out(t, i):
                    for r, z in zip(refs[i], _grads(t, dtype), strict=True):
                        r.grad = z[i] + 0.5 * r.detach()
                    opts[i].step()
                if schedule:
                    scheds[i].step()
        return refs

    sched = scheduled(opt)
    for t in range(STEPS):
        for p, z in zip(params, _grads(t, torch.float32), strict=True):
            p.grad = z + 0.5 * p.detach()
            if how == "nonfinite" and t % 4 == 1:
                p.grad[t % N].view(-1)[0] = float("nan")
        mask = torch.arange(N) != t % N if how == "mask" and t % 4 == 1 else None
        if how == "nonfinite" and t % 4 == 1:
            with pytest.warns(phalanx.NonFiniteWarning, match=f"skipped members \\[{t % N}\\]"):
                opt.step()
        else:
            opt.step(mask=mask)
        if schedule:
            sched.step()
        if t == STEPS // 2:  # a state_dict round trip into a fresh optimizer
            saved = copy.deepcopy(opt.state_dict())
            opt = cls_(params, **ours, **extra)
            opt.load_state_dict(saved)
            if schedule:
                fresh = scheduled(opt)
                fresh.load_state_dict(sched.state_dict())
                sched = fresh
    exact, float32 = loop(torch.float64), loop(torch.float32)
    for i in range(N):
        for j, p in enumerate(params):
            ours_err = (p[i].double() - exact[i][j]).abs().max().item()
            loop_err = (float32[i][j].double() - exact[i][j]).abs().max().item()
            assert ours_err <= 4 * loop_err + 1e-7, f"member {i} param {j}: {ours_err} {loop_err}"


@pytest.mark.parametrize(("cls", "kwargs", "member_lr"), CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("how", ["all", "mask", "nonfinite"])
def test_default_mode_is_float_rounding_of_the_float64_update(cls, kwargs, member_lr, how):
    _check_float_rounding(cls, kwargs, RATES.tolist() if member_lr else None, how)


@pytest.mark.parametrize(("cls", "kwargs", "member_lr"), CASES, ids=lambda v: str(v))
def test_default_mode_is_float_rounding_in_blocks_of_a_few_rows(
    cls, kwargs, member_lr, monkeypatch
):
    """Blocks of 16 elements: rows of members cut across blocks, as large tensors are."""
    monkeypatch.setattr(phalanx.optim.MemberOptimizer, "BLOCK", 16)
    _check_float_rounding(cls, kwargs, RATES.tolist() if member_lr else None, "all")


@pytest.mark.parametrize(("cls", "kwargs", "member_lr"), CASES, ids=lambda v: str(v))
def test_default_mode_follows_a_scheduler_through_a_checkpoint(cls, kwargs, member_lr):
    _check_float_rounding(cls, kwargs, RATES.tolist() if member_lr else None, "all", schedule=True)


@pytest.mark.parametrize(("cls", "kwargs"), PER_MEMBER, ids=lambda v: str(v))
@pytest.mark.parametrize("how", ["all", "mask", "nonfinite"])
@pytest.mark.parametrize("views", [True, False], ids=["views", "blocked"])
def test_per_member_values_are_float_rounding_on_views_and_blocks(
    cls, kwargs, how, views, monkeypatch
):
    """Large members (here: any, the threshold lowered) step on their views with torch's
    kernel; small ones on the blocked arithmetic. Both: float rounding, member by member."""
    if views:
        monkeypatch.setattr(phalanx.optim._blocked, "VIEW_ELEMENTS", 1)
    _check_float_rounding(cls, kwargs, RATES.tolist(), how, schedule=how == "all")


@pytest.mark.filterwarnings("ignore::phalanx.CompileWarning")
@pytest.mark.parametrize(("cls", "kwargs"), PER_MEMBER, ids=lambda v: str(v))
@pytest.mark.parametrize("how", ["all", "mask", "nonfinite"])
def test_large_stacks_compile_the_rule_to_float_rounding(cls, kwargs, how, monkeypatch):
    """The generated kernel (the rule's update compiled, ``_generated``), taken here at any
    size: float rounding, member by member, with masks, skipped members, a scheduler and a
    state_dict round trip."""
    monkeypatch.setattr(phalanx.optim._generated, "GENERATED_ELEMENTS", 1)
    calls = []
    real = phalanx.optim._generated.generated_step
    monkeypatch.setattr(
        phalanx.optim._base, "generated_step", lambda *a: calls.append(1) or real(*a)
    )
    _check_float_rounding(cls, kwargs, RATES.tolist(), how, schedule=how == "all")
    assert calls and "failed" not in phalanx.optim._generated._compiled


@pytest.mark.filterwarnings("ignore::phalanx.CompileWarning")
@pytest.mark.parametrize(("cls", "kwargs", "member_lr"), CASES, ids=lambda v: str(v))
def test_large_stacks_with_per_member_rates_compile_the_rule(cls, kwargs, member_lr, monkeypatch):
    monkeypatch.setattr(phalanx.optim._generated, "GENERATED_ELEMENTS", 1)
    _check_float_rounding(cls, kwargs, RATES.tolist() if member_lr else None, "mask")


def test_the_generated_kernel_is_announced_once(monkeypatch) -> None:
    monkeypatch.setattr(phalanx.optim._generated, "GENERATED_ELEMENTS", 1)
    monkeypatch.setattr(phalanx.optim._generated, "_announced", set())
    p = nn.Parameter(torch.randn(N, 4, 3))
    opt = phalanx.optim.Lion([p], lr=RATES.clone())
    p.grad = torch.randn_like(p)
    with pytest.warns(phalanx.CompileWarning, match=r"Lion.step\(\): compiling this rule"):
        opt.step()
    opt.step()  # once: a second step says nothing (warnings are errors in this suite)


@pytest.mark.parametrize(("cls", "kwargs", "member_lr"), CASES, ids=lambda v: str(v))
def test_large_members_with_per_member_rates_step_on_their_views(
    cls, kwargs, member_lr, monkeypatch
):
    monkeypatch.setattr(phalanx.optim._blocked, "VIEW_ELEMENTS", 1)
    _check_float_rounding(cls, kwargs, RATES.tolist() if member_lr else None, "all")


@pytest.mark.parametrize("views", [True, False], ids=["large", "small"])
def test_large_members_with_per_member_values_take_the_kernel_on_their_views(
    views, monkeypatch
) -> None:
    if views:
        monkeypatch.setattr(phalanx.optim._blocked, "VIEW_ELEMENTS", 1)
    p = nn.Parameter(torch.randn(N, 4, 3))
    opt = phalanx.optim.Adam([p], lr=1e-2, betas=(torch.linspace(0.8, 0.9, N), 0.999))
    for t in range(3):
        p.grad = torch.randn_like(p)
        with KernelSpy() as spy:
            opt.step(mask=torch.arange(N) != t)
        assert spy.calls == (N - 1 if views else 0)  # a call per set of members sharing values


@pytest.mark.parametrize(("cls", "kwargs"), [(c, k) for c, k, _ in CASES], ids=lambda v: str(v))
def test_shared_values_take_one_fused_call_on_the_stacked_tensors_bit_for_bit(cls, kwargs):
    """One kernel call a step (at any N), bit for bit torch's fused optimizer on the stacked
    tensors. That is not torch's fused kernel on member i alone: the kernel's vector body and
    scalar tail round differently and a member's elements fall in either by its offset."""
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(N, *s, generator=g)) for s in SHAPES]
    refs = [nn.Parameter(p.detach().clone()) for p in params]
    opt = getattr(phalanx.optim, cls)(params, **kwargs)
    ref = getattr(torch.optim, cls)(refs, **kwargs, fused=True)
    for t in range(6):
        for p, r, z in zip(params, refs, _grads(t, torch.float32), strict=True):
            p.grad, r.grad = z.clone(), z.clone()
        with KernelSpy() as spy:
            opt.step()
        ref.step()
        assert spy.calls == 1, f"step {t}: {spy.calls} kernel calls"
    for j, (p, r) in enumerate(zip(params, refs, strict=True)):
        assert torch.equal(p, r), f"param {j}"
        for key, value in ref.state[r].items():
            if key != "step":
                assert torch.equal(opt.state[p][key], value), f"param {j} {key}"


def test_a_mask_leaves_the_fast_kernel_and_a_load_of_shared_counts_returns_to_it() -> None:
    p = nn.Parameter(torch.randn(N, 4))
    opt = phalanx.optim.Adam([p], lr=1e-2)
    twin = phalanx.optim.Adam([nn.Parameter(p.detach().clone())], lr=1e-2, mode="torch")

    def step(mask: torch.Tensor | None = None) -> int:
        p.grad = torch.ones_like(p)
        with KernelSpy() as spy:
            opt.step(mask=mask)
        return spy.calls

    assert step() == 1
    assert step(torch.arange(N) != 2) == 0  # member 2 a step behind: blocked arithmetic
    assert step() == 0  # the counts may differ now: never one count for all
    assert opt.state[p]["step"].tolist() == [3, 3, 2, 3, 3]
    opt.state[p]["step"].fill_(3)  # shared again (a load reads them: one host read)
    state = copy.deepcopy(opt.state_dict())
    fresh = phalanx.optim.Adam([p], lr=1e-2)
    fresh.load_state_dict(state)
    twin.load_state_dict(state)
    assert fresh.state[p]["step"].dtype == torch.float32
    assert twin.state[twin.param_groups[0]["params"][0]]["step"].dtype == torch.float64
    p.grad = torch.ones_like(p)
    with KernelSpy() as spy:
        fresh.step()
    assert spy.calls == 1
    assert fresh.state[p]["step"].tolist() == [4.0] * N


def test_mode_keyword_is_checked() -> None:
    w = [nn.Parameter(torch.zeros(2, 3))]
    with pytest.raises(ValueError, match=r"mode='exact' is not one of"):
        phalanx.optim.Adam(w, mode="exact")
    with pytest.raises(ValueError, match=r"fused=True asks for mode='fused'"):
        phalanx.optim.SGD(w, fused=True, mode="torch")
    with pytest.raises(ValueError, match=r"Lion\(\): mode='fused' needs torch's fused kernel"):
        phalanx.optim.Lion(w, mode="fused")
    assert phalanx.optim.AdamW(w, fused=True).mode == "fused"
    assert phalanx.optim.AdamW(w).mode == "fast"


def test_group_lr_is_a_true_rate_for_tools_that_log_it() -> None:
    """group["lr"] is the largest member's rate (the one all members share, if they do), so a
    tool that logs param_groups[i]["lr"] (Lightning's LearningRateMonitor) logs a true rate;
    schedulers still scale every member by one factor."""
    w = [nn.Parameter(torch.zeros(3, 2))]
    opt = phalanx.optim.Adam(w, lr=[1e-3, 1e-2, 1e-4])
    group = opt.param_groups[0]
    assert group["lr"] == 1e-2 and "lr: 0.01" in repr(opt)
    assert opt.hyperparameters()["lr"].tolist() == [1e-3, 1e-2, 1e-4]  # exactly, no rounding
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    w[0].grad = torch.ones_like(w[0])
    opt.step()
    sched.step()
    assert group["lr"] == 5e-3
    assert opt.hyperparameters()["lr"].tolist() == [5e-4, 5e-3, 5e-5]
    assert phalanx.optim.SGD(w, lr=[0.1, 0.1, 0.1]).param_groups[0]["lr"] == 0.1
    assert phalanx.optim.SGD(w, lr=torch.zeros(3)).param_groups[0]["lr"] == 1.0  # all 0: 1.0


def test_a_checkpoint_keeps_the_factor_so_ranks_with_other_members_save_alike() -> None:
    """Saved, a per-member group's lr is the factor on the members' rates (1.0, then what a
    scheduler made it): the same on two ranks holding different members; loaded, group["lr"]
    is a true rate again, and every member's rate is as it was."""
    w1, w2 = [nn.Parameter(torch.zeros(2, 3))], [nn.Parameter(torch.zeros(2, 3))]
    a = phalanx.optim.SGD(w1, lr=[0.1, 0.2])
    b = phalanx.optim.SGD(w2, lr=[0.3, 0.4])
    for opt, w in ((a, w1), (b, w2)):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        w[0].grad = torch.zeros_like(w[0])
        opt.step()
        sched.step()
    saved = [o.state_dict()["param_groups"][0] for o in (a, b)]
    assert saved[0]["lr"] == saved[1]["lr"] == 0.5 and saved[0]["initial_lr"] == 1.0
    assert "lr_reference" not in saved[0]
    fresh = phalanx.optim.SGD(w1, lr=[0.1, 0.2])
    fresh.load_state_dict(copy.deepcopy(a.state_dict()))
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.1)
    torch.testing.assert_close(fresh.hyperparameters()["lr"], a.hyperparameters()["lr"])


@pytest.mark.parametrize(
    ("cls", "kwargs", "kernel"),
    [
        ("Adam", {}, True),
        ("AdamW", {"weight_decay": 0.1}, True),
        ("Adam", {"weight_decay": 0.1}, True),  # the decay added on the block first
        ("SGD", {"momentum": 0.9}, True),
    ],
)
def test_per_member_rates_take_the_fused_kernel_where_the_step_is_linear_in_lr(
    cls, kwargs, kernel
) -> None:
    p = nn.Parameter(torch.randn(N, 4, 3))
    opt = getattr(phalanx.optim, cls)([p], lr=RATES.clone(), **kwargs)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        with KernelSpy() as spy:
            opt.step()
        assert (spy.calls > 0) == kernel
