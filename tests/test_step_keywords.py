"""``compile_step`` on a model driven by keywords that computes its own loss (``loss_fn=None``,
the output's ``.loss``), captured and eager, against the members trained one by one."""

from __future__ import annotations

import copy

import pytest
import torch

import phalanx
from conftest import assert_close
from test_keywords import Masked, N, _data

STEPS = 3


def _members() -> list[Masked]:
    torch.manual_seed(0)
    return [Masked() for _ in range(N)]


def _reference(members, x, mask, label):
    """Each member alone with torch.optim.Adam: the losses of every step, the final weights."""
    losses = []
    for i, m in enumerate(members):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        own = []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = m(x[i], pad=mask[i], label=label[i])["loss"]
            loss.backward()
            opt.step()
            own.append(loss.detach())
        losses.append(torch.stack(own))
    return torch.stack(losses, 1)  # (STEPS, N)


@pytest.mark.parametrize("prefer", ["captured", None])
def test_compile_step_takes_keywords_and_the_models_own_loss(prefer):
    members = _members()
    x, mask, _, label = _data()
    expected = _reference(copy.deepcopy(members), x, mask, label)
    trained = copy.deepcopy(members)
    _reference(trained, x, mask, label)

    stack = phalanx.stack(members)
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
    if prefer is None:  # the eager step as a user writes it, the reference of the captured

        def step(xs, *, pad, label):
            opt.zero_grad()
            out = stack(xs, in_dims=0, pad=pad, label=label, kw_in_dims=0)
            losses = phalanx.member_losses(None, out)
            losses.sum().backward()
            opt.step()
            return losses.detach()
    else:
        step = phalanx.compile_step(
            stack, None, opt, in_dims=0, kw_in_dims=0, backend="aot_eager", prefer=prefer,
            warmup_steps=1,
        )  # fmt: skip
    got = torch.stack([step(x, pad=mask, label=label) for _ in range(STEPS)])
    if prefer is not None:
        assert step.choice == "captured", step.report
    assert_close(got, expected, trajectory=True)
    for name, p in stack.module.named_parameters():
        ref = torch.stack([m.get_parameter(name).detach() for m in trained])
        assert_close(p.detach(), ref, trajectory=True, msg=name)


def test_compile_step_without_a_loss_on_an_output_without_one_says_so():
    stack = phalanx.stack(_members())
    opt = phalanx.optim.Adam(stack.parameters())
    step = phalanx.compile_step(stack, None, opt, in_dims=0, kw_in_dims=0)
    x, mask, _, _ = _data()
    with pytest.raises(TypeError, match="loss_fn=None uses the loss the model computes itself"):
        step(x, pad=mask)
