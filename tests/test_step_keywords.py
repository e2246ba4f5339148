"""``compile_step`` on a model driven by keywords that computes its own loss (``loss_fn=None``,
the output's ``.loss``), captured and eager, against the members trained one by one."""

from __future__ import annotations

import copy

import pytest
import torch

import phalanx
from helpers import assert_close
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


class Tokens(torch.nn.Module):
    """An embedding member: phalanx's embedding rule checks the ids' range as nn.Embedding does,
    which under make_fx must become a traced assertion, not a read of the ids' values."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids, *, weight=None):
        h = self.embed(ids).mean(1)
        return self.head(h if weight is None else h * weight)


def test_compile_step_captures_an_embedding_member_with_keywords():
    torch.manual_seed(0)
    members = [Tokens() for _ in range(N)]
    ids = torch.randint(0, 11, (5, 7))
    weight = torch.rand(N, 5, 1)
    y = torch.randint(0, 3, (5,))
    results = []
    for captured in (False, True):
        stack = phalanx.stack(copy.deepcopy(members))
        opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
        step = phalanx.compile_step(
            stack, torch.nn.functional.cross_entropy, opt, target_in_dims=None,
            kw_in_dims={"weight": 0}, backend="aot_eager",
            prefer="captured", warmup_steps=100 if not captured else 1,
        )  # fmt: skip
        losses = torch.stack([step(ids, y, weight=weight) for _ in range(STEPS)])
        assert step.choice == ("captured" if captured else None), step.report
        results.append((losses, [p.detach() for p in stack.parameters()]))
    (eager, eager_params), (got, got_params) = results
    assert_close(got, eager, trajectory=True)
    assert_close(got_params, eager_params, trajectory=True)
