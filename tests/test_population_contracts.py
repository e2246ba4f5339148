"""phalanx.population's promises at the edges: a foreign optimizer is refused before anything
changes, a refused explore or stop changes nothing, a replaced stack refuses to train, and
the settings that were easy to get wrong have one safe spelling."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import phalanx
from phalanx.population import (
    PBT,
    Factors,
    LogUniform,
    SuccessiveHalving,
    copy_members,
    keep_members,
    rungs,
)
from phalanx.population._mutations import mutate
from test_population import _run, _train


def _snapshot(stack, opt, loader):
    return (
        [t.detach().clone() for t in [*stack.parameters(), *stack.buffers()]],
        copy.deepcopy(opt.state_dict()),
        loader.streams.clone(),
    )


def _assert_unchanged(before, after) -> None:
    (w0, o0, s0), (w1, o1, s1) = before, after
    assert all(torch.equal(a, b) for a, b in zip(w0, w1, strict=True)), "weights changed"
    assert torch.equal(s0, s1), "data streams changed"
    for g0, g1 in zip(o0["param_groups"], o1["param_groups"], strict=True):
        for key, value in g0.items():
            other = g1[key]
            same = (
                torch.equal(torch.as_tensor(value), torch.as_tensor(other))
                if isinstance(value, torch.Tensor | tuple) and key != "params"
                else value == other
            )
            assert same, f"optimizer {key} changed"
    for k, state in o0["state"].items():
        for key, value in state.items():
            assert torch.equal(value, o1["state"][k][key]), f"optimizer state {key} changed"


FOREIGN = {
    "another stack, same N": lambda n: phalanx.optim.SGD(_run(n)[0].parameters(), lr=0.1),
    "another N": lambda n: _run(n + 2, "sgd")[1],
    "a torch optimizer": lambda n: torch.optim.SGD(_run(n)[0].parameters(), lr=0.1),
}
ENTRY_POINTS = {
    "copy_members": lambda s, o, ld: copy_members(s, [0], [1], optimizer=o, loader=ld),
    "keep_members": lambda s, o, ld: keep_members(s, [1, 0], optimizer=o, loader=ld),
    "PBT": lambda s, o, ld: PBT(s, o, {"lr": LogUniform(1e-4, 1.0)}, interval=1, mode="max"),
    "SuccessiveHalving": lambda s, o, ld: SuccessiveHalving(s, o, [1], loader=ld, mode="max"),
}


@pytest.mark.parametrize("foreign", list(FOREIGN))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_refuses_a_foreign_optimizer_changing_nothing(entry, foreign):
    stack, opt, loader = _run(4, "sgd")
    _train(stack, opt, loader, 1)
    wrong = FOREIGN[foreign](4)
    wrong_before = copy.deepcopy(wrong.state_dict())
    before = _snapshot(stack, opt, loader)
    match = r"not parameters of this stack|holds 6 members but the stack 4|torch\.optim\.sgd\.SGD"
    with pytest.raises((ValueError, TypeError), match=match):
        ENTRY_POINTS[entry](stack, wrong, loader)
    _assert_unchanged(before, _snapshot(stack, opt, loader))
    for g0, g1 in zip(wrong_before["param_groups"], wrong.state_dict()["param_groups"]):
        assert g0.keys() == g1.keys()
        for key in g0:  # its lr too: PBT once rewrote it before failing
            assert repr(g0[key]) == repr(g1[key]), key


def test_a_loader_of_another_n_is_refused_at_construction():
    stack, opt, _ = _run(4, "sgd")
    other = _run(6, "sgd")[2]
    with pytest.raises(ValueError, match=r"SuccessiveHalving\(\): the loader holds 6 members"):
        SuccessiveHalving(stack, opt, [1], loader=other, mode="max")
    with pytest.raises(ValueError, match=r"PBT\(\): the loader holds 6 members"):
        PBT(stack, opt, {"lr": Factors(2.0)}, interval=1, loader=other, mode="max")


def test_a_refused_stop_marks_no_milestone_done():
    stack, opt, loader = _run(4, "sgd")
    halving = SuccessiveHalving(stack, opt, [1, 2], loader=loader, mode="max")
    halving.optimizer = _run(4, "sgd")[1]  # swapped behind its back
    with pytest.raises(ValueError, match=r"keep_members\(\): optimizer parameters"):
        halving.stop(torch.arange(4.0), step=1)
    assert halving.ready(1) and halving.log == [] and halving.stack is stack
    assert halving.members == [0, 1, 2, 3] and len(stack) == 4


def test_set_hyperparameters_checks_everything_before_writing():
    stack = phalanx.stack([nn.Linear(3, 2) for _ in range(4)], backend="loop")
    opt = phalanx.optim.SGD(stack.parameters(), lr=0.1, momentum=0.5, nesterov=True)
    before = opt.hyperparameters()
    with pytest.raises(ValueError, match=r"SGD.set_hyperparameters\(\): member 0 uses Nesterov"):
        opt.set_hyperparameters([0], lr=0.3, momentum=0.0)
    after = opt.hyperparameters()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert opt.param_groups[0]["member_lr"] is None  # not even lr was written


def test_a_refused_explore_copies_nothing_and_draws_nothing():
    stack, opt, loader = _run(4, "sgd")
    opt.set_hyperparameters(None, nesterov=True, dampening=0.0)
    pbt = PBT(stack, opt, {"momentum": [0.0, 0.9]}, interval=1, resample_probability=1.0, seed=1,
              mode="max")  # fmt: skip
    _train(stack, opt, loader, 1)
    metric = torch.tensor([0.1, 0.9, 0.5, 0.3])
    refused = 0
    for _ in range(20):  # until an explore draws momentum 0 with Nesterov on
        before, state = _snapshot(stack, opt, loader), pbt.generator.get_state()
        try:
            pbt.exploit(metric, step=pbt.last_step + 1)
        except ValueError as e:
            assert "Nesterov" in str(e)
            _assert_unchanged(before, _snapshot(stack, opt, loader))
            assert torch.equal(pbt.generator.get_state(), state)
            refused += 1
            pbt.generator.manual_seed(100 + refused)
    assert refused > 0, "no explore drew the refused value: the test tested nothing"


def test_a_list_mutation_finds_a_float32_value_in_its_list():
    g = torch.Generator().manual_seed(0)
    value = float(torch.tensor(0.9, dtype=torch.float32))  # 0.8999999762
    drawn = {
        mutate(value, [0.5, 0.9, 0.99], resample_probability=0.0, factors=(1.2,), generator=g)
        for _ in range(40)
    }
    assert drawn == {0.5, 0.99}  # always a neighbour, never a resample to 0.9


@pytest.mark.parametrize("order", [[3, 2, 1, 0], [2, 0]])
def test_member_lambda_lr_follows_kept_and_copied_members(order):
    stack = phalanx.stack([nn.Linear(3, 2) for _ in range(4)], backend="loop")
    lrs = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    opt = phalanx.optim.SGD(stack.parameters(), lr=lrs)
    sched = phalanx.optim.MemberLambdaLR(opt, lambda epoch: 0.5**epoch)
    stack = keep_members(stack, order, optimizer=opt)
    sched.step()
    assert opt.hyperparameters()["lr"].tolist() == (lrs[order] * 0.5).tolist()
    copy_members(stack, [0], [1], optimizer=opt)
    sched.step()
    assert opt.hyperparameters()["lr"].tolist()[1] == float(lrs[order[0]] * 0.25)
    stack(torch.randn(5, 3)).sum().backward()
    opt.step()  # the rates fit the smaller stack
    with pytest.raises(ValueError, match=r"PBT\(\): a per-member schedule \(MemberLambdaLR\)"):
        PBT(stack, opt, {"lr": Factors(2.0)}, interval=1, mode="max")


def test_a_replaced_stack_refuses_to_train_and_to_be_operated_on():
    stack, opt, loader = _run(4, "sgd")
    halving = SuccessiveHalving(stack, opt, [1], loader=loader, mode="max")
    small = halving.stop(torch.arange(4.0), step=1)
    x = torch.randn(8, 5)
    with pytest.raises(RuntimeError, match=r"Stack.forward\(\): this stack of 4 members was "):
        stack(x)
    with torch.no_grad():
        assert stack(x).shape[0] == 4  # evaluating the old weights is still fine
    with pytest.raises(ValueError, match=r"copy_members\(\): this stack of 4 members was replaced"):
        copy_members(stack, [0], [1])
    assert small(x).shape[0] == 2


def test_mode_must_be_said_and_rungs_carry_their_reduction_factor():
    stack, opt, loader = _run(9, "sgd")
    with pytest.raises(ValueError, match=r"PBT\(\): mode must be 'max' .* or 'min' \(a loss\)"):
        PBT(stack, opt, {"lr": Factors(2.0)}, interval=1)
    with pytest.raises(ValueError, match=r"SuccessiveHalving\(\): mode must be 'max'"):
        SuccessiveHalving(stack, opt, [2])
    milestones = rungs(2, 3, 20)
    assert milestones == [2, 6, 18] and milestones.reduction_factor == 3
    with pytest.raises(ValueError, match=r"made by rungs\(\) with reduction_factor=3, but "):
        SuccessiveHalving(stack, opt, milestones, reduction_factor=2, mode="max")
    halving = SuccessiveHalving(stack, opt, milestones, loader=loader, mode="max")
    assert len(halving.stop(torch.arange(9.0), step=2)) == 3  # eta 3 keeps 3 of 9


def test_pbt_mutates_adams_betas_one_at_a_time():
    stack, opt, _ = _run(4, "adam")
    pbt = PBT(stack, opt, {"beta1": [0.8, 0.9, 0.95]}, interval=1, resample_probability=0.0,
              mode="max")  # fmt: skip
    beta2 = opt.hyperparameters()["betas"][1].clone()
    (event,) = pbt.exploit(torch.tensor([0.1, 0.9, 0.5, 0.3]), step=1)
    betas = opt.hyperparameters()["betas"]
    assert float(betas[0][event["member"]]) == event["hyperparameters"]["beta1"] in (0.8, 0.95)
    assert torch.equal(betas[1], beta2)
