"""phalanx.optim.Adagrad against torch.optim.Adagrad on each member alone.

Adagrad was added as one file (``src/phalanx/optim/_adagrad.py``): these tests hold it to
what every rule promises, with test_optim's reference (torch.optim on each member alone).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import phalanx
from test_optim import (
    STEPS,
    Case,
    N,
    Reference,
    grads_from,
    make_params,
    noise_stream,
    per_member,
    train_alongside,
)

TORCH = {"foreach": False}  # torch's single-tensor arithmetic, as on a CPU by default

CASES = [
    Case("adagrad_defaults", phalanx.optim.Adagrad, torch.optim.Adagrad, {"lr": 0.1}),
    Case(
        "adagrad_member_everything",
        phalanx.optim.Adagrad,
        torch.optim.Adagrad,
        {
            "lr": per_member([0.1, 0.01, 0.3, 0.05]),
            "lr_decay": per_member([0.0, 0.1, 0.01, 0.5]),
            "weight_decay": per_member([0.0, 0.1, 0.0, 0.2]),
            "initial_accumulator_value": per_member([0.0, 0.1, 1.0, 0.0]),
            "eps": per_member([1e-10, 1e-3, 1e-6, 1e-10]),
            "maximize": torch.tensor([False, True, False, True]),
        },
    ),
    Case(
        "adagrad_numbers",
        phalanx.optim.Adagrad,
        torch.optim.Adagrad,
        {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 1e-2, "eps": 1e-6, "maximize": True},
    ),
]


def assert_members_equal(opt, params, ref: Reference) -> None:
    """Every member's weights and state are torch's on that member alone, bit for bit."""
    for j, p in enumerate(params):
        for i in range(N):
            theirs = ref.members[i][j]
            assert torch.equal(p[i].detach(), theirs.detach()), f"member {i} param {j}"
            state = ref.opts[i].state[theirs]
            assert torch.equal(opt.state[p]["sum"][i], state["sum"]), f"member {i} sum {j}"
            assert float(opt.state[p]["step"][i]) == float(state["step"])


@pytest.mark.parametrize("mode", ["fast", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_member_is_torch_adagrad_alone_bit_for_bit(case, dtype, mode) -> None:
    params = make_params(dtype)
    opt = case.ours(params, **case.kwargs, mode=mode)
    ref = Reference(case, params, **TORCH)
    train_alongside(opt, ref, params, STEPS)
    assert_members_equal(opt, params, ref)


def test_the_default_mode_is_float_rounding_of_the_float64_update() -> None:
    """In float32, no member is further from the float64 run than torch's float32 run is."""
    case = CASES[1]
    params = make_params(torch.float32)
    wide = [nn.Parameter(p.detach().double()) for p in params]
    opt = case.ours(params, **case.kwargs)
    ref = Reference(case, wide, **TORCH)
    ref32 = Reference(case, params, **TORCH)
    noise = noise_stream(wide)
    for _ in range(STEPS):
        z = next(noise)
        z32 = [t.float() for t in z]
        for p, g in zip(params, grads_from(params, z32), strict=True):
            p.grad = g
        opt.step()
        ref.step(z)
        ref32.step(z32)
    for j, p in enumerate(params):
        for i in range(N):
            exact = ref.members[i][j].detach()
            ours = (p[i].detach().double() - exact).abs().max()
            torchs = (ref32.members[i][j].detach().double() - exact).abs().max()
            assert ours <= 2 * torchs + 1e-12, f"member {i} param {j}: {ours} vs torch {torchs}"


def test_masked_members_keep_weights_state_and_counts() -> None:
    case = CASES[1]
    params = make_params(torch.float32)
    opt = case.ours(params, **case.kwargs)
    ref = Reference(case, params, **TORCH)
    noise = noise_stream(params)
    masks = [
        torch.tensor([True, False, True, True]),
        None,
        torch.tensor([False, True, True, False]),
    ]
    for mask in masks * 3:
        z = next(noise)
        for p, g in zip(params, grads_from(params, z), strict=True):
            p.grad = g
        opt.step(mask=mask)
        ref.step(z, mask)
    assert_members_equal(opt, params, ref)


def test_skip_nonfinite_skips_the_member_and_steps_the_others() -> None:
    case = CASES[1]
    params = make_params(torch.float32)
    opt = case.ours(params, **case.kwargs, skip_nonfinite=True)
    ref = Reference(case, params, **TORCH)
    noise = noise_stream(params)
    for k in range(4):
        z = next(noise)
        for p, g in zip(params, grads_from(params, z), strict=True):
            p.grad = g
        if k == 1:
            params[0].grad[2, 0, 0] = float("nan")
            with pytest.warns(phalanx.optim.NonFiniteWarning, match=r"skipped members \[2\]"):
                opt.step()
            ref.step(z, torch.tensor([True, True, False, True]))
        else:
            opt.step()
            ref.step(z)
    assert opt.bad_steps.tolist() == [0, 0, 1, 0]
    assert_members_equal(opt, params, ref)


def test_state_dict_round_trip_continues_identically() -> None:
    case = CASES[1]
    params = make_params(torch.float32)
    opt = case.ours(params, **case.kwargs)
    noise = noise_stream(params)
    for _ in range(3):
        for p, g in zip(params, grads_from(params, next(noise)), strict=True):
            p.grad = g
        opt.step(mask=torch.tensor([True, False, True, True]))
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    twin = case.ours(copies, **case.kwargs)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(3):
        z = next(noise)
        for ps, o in ((params, opt), (copies, twin)):
            for p, g in zip(ps, grads_from(ps, z), strict=True):
                p.grad = g
            o.step()
    for a, b in zip(params, copies, strict=True):
        assert torch.equal(a, b)
    adam = phalanx.optim.Adam(params)
    adam.step()
    with pytest.raises(ValueError, match=r"Adagrad.load_state_dict\(\): the state dict is not"):
        phalanx.optim.Adagrad(copies).load_state_dict(adam.state_dict())


def test_set_hyperparameters_reads_the_table() -> None:
    params = make_params(torch.float32)
    opt = phalanx.optim.Adagrad(params, lr=0.1)
    opt.set_hyperparameters([1, 3], lr_decay=0.5, eps=torch.tensor([1e-3, 1e-4]))
    assert opt.hyperparameters()["lr_decay"].tolist() == [0.0, 0.5, 0.0, 0.5]
    with pytest.raises(ValueError, match=r"'momentum' is not a per-member hyperparameter of "
                       r"phalanx.optim.Adagrad; choose from lr, lr_decay, weight_decay"):  # fmt: skip
        opt.set_hyperparameters([0], momentum=0.9)
    with pytest.raises(ValueError, match=r"Adagrad\(\): lr_decay is -1.0 for member 2"):
        phalanx.optim.Adagrad(params, lr_decay=torch.tensor([0.0, 0.0, -1.0, 0.0]))
    with pytest.raises(ValueError, match=r"Adagrad\(\): mode='fused' needs torch's fused kernel"):
        phalanx.optim.Adagrad(params, mode="fused")


def test_one_cycle_with_momentum_is_refused_as_torch_refuses_it() -> None:
    """torch.optim.Adagrad has no momentum, so torch's OneCycleLR (cycle_momentum=True, its
    default) refuses it; phalanx refuses it too, naming the fix, and writes nothing."""
    one_cycle = torch.optim.lr_scheduler.OneCycleLR
    with pytest.raises(ValueError, match="cycle_momentum"):
        one_cycle(torch.optim.Adagrad([nn.Parameter(torch.zeros(2))]), max_lr=0.1, total_steps=9)
    params = make_params(torch.float32)
    opt = phalanx.optim.Adagrad(params, lr=0.1)
    with pytest.raises(ValueError, match="cycle_momentum"):
        one_cycle(opt, max_lr=0.1, total_steps=9)  # torch's own, on one rate for all
    with pytest.raises(
        ValueError,
        match=r"MemberScheduler\(\): the scheduler cycles momentum .* phalanx.optim.Adagrad has "
        r"no momentum-like setting .* Pass cycle_momentum=False",
    ):
        phalanx.optim.MemberScheduler(opt, lambda o: one_cycle(o, max_lr=0.1, total_steps=9))
    assert all("momentum" not in g for g in opt.param_groups)


def test_one_cycle_without_momentum_schedules_each_member_as_torch() -> None:
    case = CASES[1]
    params = make_params(torch.float32)
    opt = case.ours(params, **case.kwargs)
    ref = Reference(case, params, **TORCH)
    max_lr = [0.2, 0.05, 0.5, 0.1]

    sched = phalanx.optim.MemberScheduler(
        opt,
        lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=max_lr, total_steps=STEPS, cycle_momentum=False
        ),
    )
    theirs = [
        torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=max_lr[i], total_steps=STEPS, cycle_momentum=False
        )
        for i, o in enumerate(ref.opts)
    ]
    train_alongside(opt, ref, params, STEPS - 1, schedulers=[sched, *theirs])
    for i, o in enumerate(ref.opts):
        assert float(opt.hyperparameters()["lr"][i]) == o.param_groups[0]["lr"]
    assert_members_equal(opt, params, ref)
