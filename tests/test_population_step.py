"""The population drivers' training step (``train_step``): captured or eager by ``step=``, the
same members either way to float rounding, through exploits, halving and a resume."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.population import PBT, LogUniform, SuccessiveHalving, TrainStep, rungs

N = 8
X = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
Y = (X @ torch.randn(4, 1, generator=torch.Generator().manual_seed(1))).tanh()


def make(dtype, nan_member=None):
    stack = phalanx.stack(
        lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), num_members=N, seed=0
    ).to(dtype)
    if nan_member is not None:
        with torch.no_grad():
            stack.module[0].weight[nan_member, 0, 0] = math.nan  # diverged: NaN losses all along
    opt = phalanx.optim.Adam(stack.parameters(), lr=torch.logspace(-3, -1, N))
    return stack, opt


def assert_members_equal(got, eager, eager64, members=None):
    for (name, p), q, q64 in zip(got.named_parameters(), eager.parameters(), eager64.parameters()):
        for i in members if members is not None else range(len(p)):
            phalanx.testing.assert_equal_to_loop(p[i], q[i], q64[i], what=f"member {i} {name}")


def pbt_run(mode, dtype, steps=24):
    stack, opt = make(dtype, nan_member=2)
    pbt = PBT(stack, opt, {"lr": LogUniform(1e-3, 1e-1)}, interval=8, mode="min", seed=0)
    step = pbt.train_step(F.mse_loss, step=mode, backend="aot_eager")
    x, y = X.to(dtype), Y.to(dtype)
    for k in range(1, steps + 1):
        losses = step(x, y)
        if pbt.ready(k):
            pbt.exploit(phalanx.metrics.loss(F.mse_loss, stack(x), y), step=k)
    return stack, pbt, step, losses


def test_pbt_with_the_captured_step_gives_the_eager_steps_members():
    eager, pbt_e, _, _ = pbt_run("eager", torch.float32)
    eager64, _, _, _ = pbt_run("eager", torch.float64)
    got, pbt_c, step, losses = pbt_run("captured", torch.float32)
    assert step.choice == "captured" and "captured" in step.report
    # the diverged member 2 ranked last and was replaced at the first exploit; the exploits
    # (sources, targets) are the eager run's
    assert [(e["member"], e["source"]) for e in pbt_c.log] == [
        (e["member"], e["source"]) for e in pbt_e.log
    ]
    assert 2 in [e["member"] for e in pbt_c.log[:2]]  # the first exploit's targets
    assert torch.isfinite(losses).all()
    assert_members_equal(got, eager, eager64)


def halving_run(mode, dtype, steps=24, path=None, resume=None):
    stack, opt = make(dtype, nan_member=5)
    halving = SuccessiveHalving(stack, opt, rungs(6, 2, steps), mode="min")
    first = 1
    if resume is not None:
        halving.load(resume)
        first = halving.last_step + 1
    step = halving.train_step(F.mse_loss, step=mode, backend="aot_eager", max_norm=1.0)
    x, y = X.to(dtype), Y.to(dtype)
    for k in range(first, steps + 1):
        step(x, y)
        if halving.ready(k):
            halving.stop(phalanx.metrics.loss(F.mse_loss, halving.stack(x), y), step=k)
            if k == 12 and path is not None:
                halving.save(path)
    return halving, step


def test_halving_with_the_captured_step_follows_the_shrinking_stack_and_resumes(tmp_path):
    eager, _ = halving_run("eager", torch.float32)
    eager64, _ = halving_run("eager", torch.float64)
    got, step = halving_run("captured", torch.float32, path=tmp_path / "h.safetensors")
    assert step.choice == "captured"
    assert got.members == eager.members and 5 not in got.log[0]["kept"]  # NaN stopped first
    assert step.stack is got.stack and len(got.stack) == len(got.members)
    assert_members_equal(got.stack, eager.stack, eager64.stack)
    resumed, _ = halving_run("captured", torch.float32, resume=tmp_path / "h.safetensors")
    assert resumed.members == got.members
    assert_members_equal(resumed.stack, eager.stack, eager64.stack)


def test_the_step_is_chosen_said_and_checked():
    stack, opt = make(torch.float32)
    chosen = []
    step = TrainStep(stack, F.mse_loss, opt, on_choice=chosen.append, backend="aot_eager")
    assert step.mode == "auto" and step.choice is None
    for _ in range(40):  # the warm-up, the capture, then captured and eager alternating
        step(X, Y)
        if step.choice is not None:
            break
    assert chosen == [step.choice] and step.choice in ("captured", "eager")
    assert step.report.startswith(f"the {step.choice} step (step='auto'")
    eager = TrainStep(stack, F.mse_loss, opt, step="eager", on_choice=chosen.append)
    eager(X, Y)
    assert eager.choice == "eager" and chosen[-1] == "eager"
    with pytest.raises(ValueError, match=r"step must be 'auto'.*'captured' or 'eager'; got 'fast'"):
        TrainStep(stack, F.mse_loss, opt, step="fast")
    with pytest.raises(TypeError, match=r"phalanx optimizer.*got SGD"):
        TrainStep(stack, F.mse_loss, torch.optim.SGD(stack.parameters(), lr=0.1))


def test_the_eager_step_masks_clips_and_reports_norms_as_the_captured_one():
    runs = {}
    for mode in ("eager", "captured"):
        stack, opt = make(torch.float32)
        step = TrainStep(stack, F.mse_loss, opt, step=mode, max_norm=0.05, backend="aot_eager")
        keep = torch.arange(N) % 2 == 0
        for _ in range(6):
            step(X, Y, mask=keep)
        runs[mode] = (stack, step.last_norms)
    (a, na), (b, nb) = runs["eager"], runs["captured"]
    torch.testing.assert_close(na, nb)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)
    fresh, _ = make(torch.float32)
    for p, q in zip(a.parameters(), fresh.parameters()):  # masked-out members never moved
        assert torch.equal(p[1::2], q[1::2])
