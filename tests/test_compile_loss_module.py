"""A forward that computes its own loss with an ``nn.CrossEntropyLoss()`` module (every
Hugging Face model does), under ``torch.compile(stack)``: per-member losses equal to the loop's.

The vmapped forward runs eagerly inside the compiled call (TorchDynamo cannot trace a custom
Function's vmap rule), so the loss module, made in the forward or held on ``self``, is the
member's own code run under vmap: one loss per member."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import phalanx
from helpers import assert_close

N, B, C = 4, 5, 3


class OwnLoss(nn.Module):
    def __init__(self, held: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, C)
        self.loss_fct = nn.CrossEntropyLoss() if held else None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lin(x)
        loss_fct = self.loss_fct if self.loss_fct is not None else nn.CrossEntropyLoss()
        return logits, loss_fct(logits.view(-1, C), y.view(-1))


@pytest.mark.parametrize("held", [False, True], ids=["made_in_forward", "held_on_self"])
@pytest.mark.parametrize("backend", ["fused", "auto"])
def test_compiled_stack_with_a_loss_module_is_per_member(backend, held):
    torch.manual_seed(0)
    members = [OwnLoss(held) for _ in range(N)]
    reference = copy.deepcopy(members)
    stack = phalanx.stack(members, backend=backend)
    x, y = torch.randn(B, 8), torch.randint(0, C, (B,))

    logits, loss = torch.compile(stack, backend="aot_eager")(x, y)
    expected = [m(x, y) for m in reference]
    assert loss.shape == (N,)
    assert_close(loss, torch.stack([e[1] for e in expected]), msg="losses")
    assert_close(logits, torch.stack([e[0] for e in expected]), msg="logits")
    loss.sum().backward()
    sum(e[1] for e in expected).backward()
    for name, p in stack.named_parameters():
        leaf = name.removeprefix("module.")
        for i, m in enumerate(reference):
            assert_close(p.grad[i], m.get_parameter(leaf).grad, msg=f"member {i} grad {leaf}")
