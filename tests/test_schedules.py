"""Schedulers and per-member learning rates: every torch scheduler means for member i what it
means in torch for member i alone, or is refused naming the per-member alternative.

`phalanx.optim.MemberScheduler` runs a torch scheduler for each member: compared bit for bit
with torch.optim plus that scheduler on each member alone. A torch scheduler attached directly
scales one factor on every member's rate: exact in meaning for schedulers of factors (to
rounding: rate * factor against torch's recursion on the rate), refused for those with rates
in them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import phalanx
import phalanx.population as population

S = torch.optim.lr_scheduler
N = 3


def _schedules() -> st.SearchStrategy[tuple[str, Any]]:
    """(name, make) pairs over torch's schedulers, their arguments drawn."""
    rate = st.floats(1e-5, 1e-2)
    return st.one_of(
        st.builds(lambda t, e: ("CosineAnnealingLR", lambda o: S.CosineAnnealingLR(o, t, e)),
                  st.integers(2, 8), rate | st.just(0.0)),
        st.builds(lambda t, e: ("WarmRestarts", lambda o: S.CosineAnnealingWarmRestarts(o, t, eta_min=e)),
                  st.integers(1, 4), rate),
        st.builds(lambda m, p: ("OneCycleLR", lambda o: S.OneCycleLR(o, max_lr=m, total_steps=12, pct_start=p)),
                  st.floats(1e-3, 0.2), st.floats(0.1, 0.9)),
        st.builds(lambda b: ("CyclicLR", lambda o: S.CyclicLR(o, base_lr=b, max_lr=0.05, step_size_up=2)),
                  rate),
        st.builds(lambda f, m: ("ReduceLROnPlateau", lambda o: S.ReduceLROnPlateau(o, factor=f, min_lr=m, patience=0)),
                  st.floats(0.1, 0.9), rate | st.just(0.0)),
        st.builds(lambda g: ("ExponentialLR", lambda o: S.ExponentialLR(o, g)), st.floats(0.5, 0.99)),
        st.builds(lambda k, g: ("StepLR", lambda o: S.StepLR(o, k, g)), st.integers(1, 4), st.floats(0.1, 0.9)),
        st.builds(lambda f, e: ("SequentialLR", lambda o: S.SequentialLR(
            o, [S.LinearLR(o, f, total_iters=3), S.CosineAnnealingLR(o, 6, eta_min=e)], milestones=[3])),
                  st.floats(0.05, 0.9), rate),
    )  # fmt: skip


OPTIMIZERS = {
    "SGD": (phalanx.optim.SGD, torch.optim.SGD, {"momentum": 0.9}),
    "Adam": (phalanx.optim.Adam, torch.optim.Adam, {}),
}


def _train(opt, scheduler, refs, ref_opts, ref_scheds, w, steps: int = 10) -> None:
    """`steps` steps of the stack and of each member alone, each followed by a schedule step
    (ReduceLROnPlateau sees member i's own metric)."""
    g = torch.Generator().manual_seed(0)
    plateau = isinstance(ref_scheds[0], S.ReduceLROnPlateau)
    for t in range(steps):
        z = torch.randn(N, 5, generator=g)
        w.grad = 0.5 * w.detach() + z
        opt.step()
        metric = torch.tensor([1.0, 1.0 / (t + 1), 2.0]) if plateau else None
        scheduler.step(metric) if plateau else scheduler.step()
        for i in range(N):
            refs[i].grad = 0.5 * refs[i].detach() + z[i]
            ref_opts[i].step()
            ref_scheds[i].step(float(metric[i])) if plateau else ref_scheds[i].step()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schedule=_schedules(),
    lrs=st.lists(st.floats(1e-4, 1e-1), min_size=N, max_size=N),
    kind=st.sampled_from(list(OPTIMIZERS)),
)
def test_member_scheduler_gives_each_member_torchs_schedule_bit_for_bit(schedule, lrs, kind):
    name, make = schedule
    ours, theirs, kwargs = OPTIMIZERS[kind]
    w = nn.Parameter(torch.randn(N, 5, generator=torch.Generator().manual_seed(1)))
    # bit for bit is mode="torch"'s promise (the default promises float rounding)
    opt = ours([w], lr=torch.tensor(lrs, dtype=torch.float64), mode="torch", **kwargs)
    scheduler = phalanx.optim.MemberScheduler(opt, make)
    refs = [nn.Parameter(w[i].detach().clone()) for i in range(N)]
    ref_opts = [theirs([r], lr=lrs[i], **kwargs) for i, r in enumerate(refs)]
    ref_scheds = [make(o) for o in ref_opts]
    _train(opt, scheduler, refs, ref_opts, ref_scheds, w)
    for i in range(N):
        assert float(opt.hyperparameters()["lr"][i]) == ref_opts[i].param_groups[0]["lr"], name
        assert torch.equal(w[i], refs[i]), f"{name}: member {i}"
        if kind == "SGD":  # OneCycleLR and CyclicLR cycle each member's momentum too
            momentum = float(opt.hyperparameters()["momentum"][i])
            assert momentum == ref_opts[i].param_groups[0]["momentum"], name


ABSOLUTE = {
    "CosineAnnealingLR(eta_min=1e-3)": (lambda o: S.CosineAnnealingLR(o, 10, eta_min=1e-3), "eta_min=0.001"),
    "WarmRestarts(eta_min=1e-4)": (lambda o: S.CosineAnnealingWarmRestarts(o, 3, eta_min=1e-4), "eta_min"),
    "OneCycleLR": (lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=10), "max_lr"),
    "CyclicLR": (lambda o: S.CyclicLR(o, base_lr=1e-3, max_lr=0.1), "base_lr / max_lr"),
    "SWALR": (lambda o: torch.optim.swa_utils.SWALR(o, swa_lr=0.05), "swa_lr"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ABSOLUTE))
def test_a_scheduler_of_rates_on_per_member_lrs_is_refused_changing_nothing(name):
    make, what = ABSOLUTE[name]
    w = nn.Parameter(torch.zeros(N, 2))
    lrs = torch.tensor([1e-2, 1e-3, 1e-4], dtype=torch.float64)
    opt = phalanx.optim.SGD([w], lr=lrs, momentum=0.9)
    with pytest.raises(ValueError, match=rf"{what}.* is a rate, not a factor.*MemberScheduler"):
        make(opt)
    assert opt.param_groups[0]["lr"] == 1e-2 and torch.equal(opt.hyperparameters()["lr"], lrs)
    assert float(opt.hyperparameters()["momentum"][0]) == 0.9


@pytest.mark.parametrize(
    ("kwargs", "what"), [({"min_lr": 5e-3}, r"min_lr=\[0.005\]"), ({}, r"eps=1e-08")]
)
def test_reduce_on_plateau_with_rates_is_refused_before_its_first_reduction(kwargs, what):
    """min_lr is a rate, and so is eps (a member alone stops reducing once its rate would
    change by less): both mean something else on a factor."""
    w = nn.Parameter(torch.zeros(N, 2))
    opt = phalanx.optim.SGD([w], lr=torch.tensor([1e-2, 1e-3, 1e-4], dtype=torch.float64))
    plateau = S.ReduceLROnPlateau(opt, patience=0, **kwargs)
    plateau.step(1.0)
    with pytest.raises(ValueError, match=rf"ReduceLROnPlateau\(\): .*{what}.* is a rate"):
        plateau.step(2.0)
    assert opt.param_groups[0]["lr"] == 1e-2  # the largest member's rate, unchanged


FACTORS = {
    "StepLR": lambda o: S.StepLR(o, 2, 0.5),
    "ExponentialLR": lambda o: S.ExponentialLR(o, 0.9),
    "CosineAnnealingLR(eta_min=0)": lambda o: S.CosineAnnealingLR(o, 6),
    "ReduceLROnPlateau(min_lr=0, eps=0)": lambda o: S.ReduceLROnPlateau(o, patience=0, eps=0),
    "LinearLR": lambda o: S.LinearLR(o, 0.1, total_iters=4),
}


@pytest.mark.parametrize("name", list(FACTORS))
def test_a_scheduler_of_factors_on_per_member_lrs_means_what_torch_means(name):
    make = FACTORS[name]
    lrs = [1e-2, 1e-3, 3e-2]
    w = nn.Parameter(torch.randn(N, 5, dtype=torch.float64))
    opt = phalanx.optim.Adam([w], lr=torch.tensor(lrs, dtype=torch.float64))
    scheduler = make(opt)
    refs = [nn.Parameter(w[i].detach().clone()) for i in range(N)]
    ref_opts = [torch.optim.Adam([r], lr=lrs[i]) for i, r in enumerate(refs)]
    ref_scheds = [make(o) for o in ref_opts]
    if isinstance(scheduler, S.ReduceLROnPlateau):  # one metric for all: theirs the same
        _train_shared_metric(opt, scheduler, refs, ref_opts, ref_scheds, w)
    else:
        _train(opt, scheduler, refs, ref_opts, ref_scheds, w)
    for i in range(N):  # lr * factor against torch's recursion on the rate: to rounding
        rate = float(opt.hyperparameters()["lr"][i])
        assert rate == pytest.approx(ref_opts[i].param_groups[0]["lr"], rel=1e-13)
        torch.testing.assert_close(w[i], refs[i], rtol=1e-12, atol=1e-14)


def _train_shared_metric(opt, scheduler, refs, ref_opts, ref_scheds, w) -> None:
    g = torch.Generator().manual_seed(0)
    for t in range(10):
        z = torch.randn(N, 5, generator=g, dtype=torch.float64)
        w.grad = 0.5 * w.detach() + z
        opt.step()
        scheduler.step(float(t % 3))
        for i in range(N):
            refs[i].grad = 0.5 * refs[i].detach() + z[i]
            ref_opts[i].step()
            ref_scheds[i].step(float(t % 3))


def test_member_scheduler_follows_member_surgery_and_checkpoints(tmp_path):
    def make(o):
        return S.OneCycleLR(o, max_lr=[0.1, 0.2, 0.3, 0.4], total_steps=20)  # per member

    stack = phalanx.stack([nn.Linear(3, 2) for _ in range(4)], backend="loop")
    opt = phalanx.optim.SGD(stack.parameters(), lr=torch.full((4,), 0.01), momentum=0.9)
    scheduler = phalanx.optim.MemberScheduler(opt, make)
    for _ in range(3):
        scheduler.step()
    phalanx.save(tmp_path / "run.safetensors", stack, optimizer=opt, scheduler=scheduler)
    alone = []
    for i in (3, 1):  # torch on one member with member i's max_lr, 5 steps
        o = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01, momentum=0.9)
        s = S.OneCycleLR(o, max_lr=0.1 * (i + 1), total_steps=20)
        for _ in range(5):
            o.step()  # no gradient: a no-op, but torch wants it before its scheduler's step
            s.step()
        alone.append(o.param_groups[0]["lr"])
    stack = population.keep_members(stack, [3, 1], optimizer=opt)
    for _ in range(2):
        scheduler.step()
    assert opt.hyperparameters()["lr"].tolist() == alone
    population.copy_members(stack, [0], [1], optimizer=opt)
    scheduler.step()
    assert opt.hyperparameters()["lr"][0] == opt.hyperparameters()["lr"][1]

    fresh = phalanx.stack([nn.Linear(3, 2) for _ in range(4)], backend="loop")
    fresh_opt = phalanx.optim.SGD(fresh.parameters(), lr=torch.full((4,), 0.01), momentum=0.9)
    fresh_scheduler = phalanx.optim.MemberScheduler(fresh_opt, make)
    phalanx.load(
        tmp_path / "run.safetensors", fresh, optimizer=fresh_opt, scheduler=fresh_scheduler
    )
    for _ in range(2):
        fresh_scheduler.step()
    assert fresh_opt.hyperparameters()["lr"][[3, 1]].tolist() == alone


def test_member_scheduler_of_one_member_and_its_errors():
    w = nn.Parameter(torch.zeros(1, 2))
    opt = phalanx.optim.SGD([w], lr=[0.1])
    plateau = phalanx.optim.MemberScheduler(
        opt, lambda o: S.ReduceLROnPlateau(o, patience=0, min_lr=0.05)
    )
    plateau.step(torch.tensor([1.0]))
    plateau.step(2.0)  # a number is every member's metric
    assert opt.hyperparameters()["lr"].tolist() == [0.05]
    step_lr = phalanx.optim.MemberScheduler(opt, lambda o: S.StepLR(o, 1))
    with pytest.raises(ValueError, match=r"MemberScheduler.step\(\): StepLR takes no metrics"):
        step_lr.step(1.0)
    with pytest.raises(TypeError, match=r"MemberScheduler\(\): expected a phalanx optimizer"):
        phalanx.optim.MemberScheduler(torch.optim.SGD([nn.Parameter(torch.zeros(2))]), S.StepLR)


def test_reduce_lr_on_plateau_takes_one_min_lr_per_member_as_documented():
    # it raised torch's "expected 1 min_lrs, got 3"; two param groups: member-major per group
    min_lrs = [0.05, 0.02, 0.001]
    ws = [nn.Parameter(torch.randn(N, 5)), nn.Parameter(torch.randn(N, 2))]
    opt = phalanx.optim.SGD([{"params": [ws[0]]}, {"params": [ws[1]], "lr": 0.2}], lr=0.1)
    group_min = [*min_lrs, *(m / 10 for m in min_lrs)]
    sched = phalanx.optim.MemberScheduler(
        opt, lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=0, min_lr=group_min)
    )
    refs = [[nn.Parameter(w[i].detach().clone()) for w in ws] for i in range(N)]
    ref_opts = [
        torch.optim.SGD([{"params": [r[0]]}, {"params": [r[1]], "lr": 0.2}], lr=0.1) for r in refs
    ]
    ref_scheds = [
        S.ReduceLROnPlateau(o, factor=0.5, patience=0, min_lr=[min_lrs[i], min_lrs[i] / 10])
        for i, o in enumerate(ref_opts)
    ]
    for t in range(8):
        metric = torch.tensor([1.0 + t, 1.0 / (t + 1), 2.0 + t])  # members 0 and 2 plateau
        sched.step(metric)
        for i in range(N):
            ref_scheds[i].step(float(metric[i]))
    for g in range(2):
        assert sched.get_last_lr()[g].tolist() == [o.param_groups[g]["lr"] for o in ref_opts]
    assert sched.get_last_lr()[0].tolist()[::2] == [min_lrs[0], min_lrs[2]]  # floors reached
