"""Adagrad with per-member hyperparameters and step counts: one rule, one file."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._arith import math_dtype, per_member
from ._base import MemberOptimizer
from ._settings import PerMember, PerMemberFlag, Setting

__all__ = ["Adagrad"]


class Adagrad(MemberOptimizer):
    """Adagrad over stacked parameters, with every hyperparameter and the step count per member.

    Member i follows the trajectory of ``torch.optim.Adagrad`` run on member i alone with
    member i's hyperparameters, bit for bit in every mode (torch's single-tensor arithmetic
    on cache-sized blocks of the stacked tensors; the default mode promises float rounding,
    see ``MemberOptimizer``, "Modes"). Each hyperparameter is a number shared by all members
    or a tensor of shape (N,), one value per member. Adagrad has no momentum: a scheduler
    that cycles momentum (OneCycleLR, CyclicLR) is refused, as torch refuses it.

    Args:
        params: stacked parameters, each of shape (N, *shape), or param group dicts.
        lr: learning rate, a number or (N,). See ``MemberOptimizer`` for how schedulers see it.
        lr_decay: learning rate decay, a number or (N,).
        weight_decay: L2 penalty added to the gradient, a number or (N,).
        initial_accumulator_value: the sum of squares' start, a number or (N,).
        eps: term added to the denominator, a number or (N,).
        maximize: maximize the objective, a bool or (N,) bool tensor.
        skip_nonfinite: skip members whose loss or gradients are not finite in a step, and
            warn which (see ``MemberOptimizer``).
        freeze_after: with ``skip_nonfinite``, freeze a member after this many skipped steps.
        warn_skipped: warn (one host sync per step) when members are skipped.
        mode: "fast" (the default) or "torch": the same blocked arithmetic, bit for bit
            torch.optim.Adagrad on member i alone.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(3, 2))  # 3 members
        >>> opt = Adagrad([w], lr=torch.tensor([0.1, 0.01, 0.001]))
        >>> w.grad = torch.ones(3, 2)
        >>> opt.step()
        >>> w[:, 0]
        tensor([-0.1000, -0.0100, -0.0010], grad_fn=<SelectBackward0>)
    """

    SETTINGS = (
        Setting("lr", "rate"),
        Setting("lr_decay", "nonneg"),
        Setting("weight_decay", "nonneg"),
        Setting("initial_accumulator_value", "nonneg"),
        Setting("eps", "nonneg"),
        Setting("maximize", "flag"),
    )

    def __init__(
        self,
        params: Any,
        lr: PerMember = 1e-2,
        lr_decay: PerMember = 0.0,
        weight_decay: PerMember = 0.0,
        initial_accumulator_value: PerMember = 0.0,
        eps: PerMember = 1e-10,
        *,
        maximize: PerMemberFlag = False,
        skip_nonfinite: bool = False,
        freeze_after: int | None = None,
        warn_skipped: bool = True,
        mode: str | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "lr_decay": lr_decay,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "eps": eps,
            "maximize": maximize,
        }
        super().__init__(
            params,
            defaults,
            skip_nonfinite=skip_nonfinite,
            freeze_after=freeze_after,
            warn_skipped=warn_skipped,
            mode=mode,
        )

    @staticmethod
    def state_names(**options: Any) -> tuple[str, ...]:
        return ("sum",)

    def init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        """The sum of squares starts at each member's ``initial_accumulator_value``."""
        start = group["initial_accumulator_value"]
        if not isinstance(start, Tensor):
            return {"sum": torch.full_like(p, start, memory_format=torch.preserve_format)}
        zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
        return {"sum": zeros.add_(per_member(start, p))}

    @staticmethod
    def values(
        h: dict[str, Any], step: Tensor, started: frozenset[str], **options: Any
    ) -> dict[str, Any]:
        """The step's rate per member, ``lr / (1 + (step - 1) * lr_decay)`` in float64 as
        torch's Python floats, negated (torch's ``value=-clr``)."""
        step = step.to(math_dtype(step.device))
        v = {k: h[k] for k in ("weight_decay", "eps", "maximize")}
        if isinstance(h["maximize"], Tensor):
            v["sign"] = torch.where(h["maximize"], -1.0, 1.0)
        lr = h["lr"]
        if not isinstance(lr, Tensor):  # a float over a tensor is reciprocal(t) * float in
            lr = torch.full((), lr, dtype=step.dtype, device=step.device)  # torch: divide
        v["neg_clr"] = -(lr / (1 + (step - 1) * h["lr_decay"]))
        return v

    @staticmethod
    def update_(
        p: Tensor,
        g: Tensor,
        state: dict[str, Tensor],
        v: dict[str, Any],
        scratch: tuple[Tensor, Tensor],
        **options: Any,
    ) -> None:
        """torch.optim.Adagrad's single-tensor step on a block, operation for operation (``a``:
        the gradient as the rule steps against it, then the step; ``b``: the denominator)."""
        a, b = scratch
        if isinstance(v["maximize"], Tensor):
            g = torch.mul(g, v["sign"], out=a)
        elif v["maximize"]:
            g = torch.neg(g, out=a)
        weight_decay = v["weight_decay"]
        if isinstance(weight_decay, Tensor):
            g = torch.addcmul(g, p, weight_decay, out=a)
        elif weight_decay != 0:  # rounded as torch's grad.add(param, alpha=weight_decay)
            g = torch.add(g, p, alpha=weight_decay, out=a)
        state["sum"].addcmul_(g, g, value=1)
        std = torch.sqrt(state["sum"], out=b).add_(v["eps"])
        # torch's addcdiv_(grad, std, value=-clr) rounds (-clr * grad) / std: the same here
        p.addcdiv_(torch.mul(g, v["neg_clr"], out=a), std)
