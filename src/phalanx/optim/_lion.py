"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): one rule, one file.

The recipe "Add an optimizer" of docs/ARCHITECTURE.md, followed: the class declares its
settings table, its state, its per-member values and its update (in place, once);
``MemberOptimizer`` runs it eagerly on blocks of the stacked tensors and
``phalanx.compile_step`` traces its pure form, derived from it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._base import MemberOptimizer
from ._settings import PerMember, PerMemberFlag, Setting

__all__ = ["Lion"]


class Lion(MemberOptimizer):
    """Lion over stacked parameters, with every hyperparameter per member.

    The update, for member i with its own hyperparameters (torch has no Lion; this is the
    paper's, with decoupled weight decay)::

        p = p * (1 - lr * weight_decay)
        c = beta1 * m + (1 - beta1) * g
        p = p - lr * sign(c)
        m = beta2 * m + (1 - beta2) * g

    Member i equals that arithmetic run on member i alone (each line one torch operation:
    ``lerp`` for the interpolations), bit for bit, whatever N and masks.

    Args:
        params: stacked parameters, each of shape (N, *shape), or param group dicts.
        lr: learning rate, a number or (N,). See ``MemberOptimizer`` for how schedulers see it.
        betas: (beta1, beta2), each a number or (N,): the interpolation of the update's
            direction and of the momentum.
        weight_decay: decoupled weight decay, a number or (N,).
        maximize: maximize the objective, a bool or (N,) bool tensor.
        skip_nonfinite: skip members whose loss or gradients are not finite in a step, and
            warn which (see ``MemberOptimizer``).
        freeze_after: with ``skip_nonfinite``, freeze a member after this many skipped steps.
        warn_skipped: warn (one host sync per step) when members are skipped.
        mode: "torch": the blocked arithmetic (torch has no fused Lion kernel), bit for bit
            the update above on member i alone. "fast" (the default): the same, but for a
            stack of 2**24 elements or more on a CPU, the update compiled once (seconds, a
            ``phalanx.CompileWarning``), equal to float rounding; see ``MemberOptimizer``,
            "Modes".

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(3, 2))  # 3 members
        >>> opt = Lion([w], lr=torch.tensor([0.1, 0.01, 0.001]))
        >>> w.grad = torch.tensor([[1.0, -1.0]] * 3)
        >>> opt.step()
        >>> w[:, 0]
        tensor([-0.1000, -0.0100, -0.0010], grad_fn=<SelectBackward0>)
    """

    SETTINGS = (
        Setting("lr", "rate"),
        Setting("betas", "unit", parts=("beta1", "beta2"), momentum=True),
        Setting("weight_decay", "nonneg"),
        Setting("maximize", "flag"),
    )

    def __init__(
        self,
        params: Any,
        lr: PerMember = 1e-4,
        betas: tuple[PerMember, PerMember] = (0.9, 0.99),
        weight_decay: PerMember = 0.0,
        *,
        maximize: PerMemberFlag = False,
        skip_nonfinite: bool = False,
        freeze_after: int | None = None,
        warn_skipped: bool = True,
        mode: str | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "weight_decay": weight_decay,
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
        return ("exp_avg",)

    @staticmethod
    def values(
        h: dict[str, Any], step: Tensor, started: frozenset[str], **options: Any
    ) -> dict[str, Any]:
        return lion_values(h)

    @staticmethod
    def update_(
        p: Tensor,
        g: Tensor,
        state: dict[str, Tensor],
        v: dict[str, Any],
        scratch: tuple[Tensor, Tensor],
        **options: Any,
    ) -> None:
        """Lion's step on a block, each line of the update above one torch operation (``a``:
        the gradient as the rule steps against it; ``b``: the direction)."""
        a, b = scratch
        if isinstance(v["maximize"], Tensor):
            g = torch.mul(g, v["sign"], out=a)
        elif v["maximize"]:
            g = torch.neg(g, out=a)
        if v["decay"] is not None:
            p.mul_(v["decay"])
        m = state["exp_avg"]
        direction = torch.lerp(m, g, v["keep1"], out=b).sign_()
        if isinstance(v["lr"], Tensor):
            p.addcmul_(direction, v["neg_lr"])
        else:
            p.add_(direction, alpha=-v["lr"])
        m.lerp_(g, v["keep2"])


def lion_values(h: dict[str, Any]) -> dict[str, Any]:
    """The numbers Lion derives from its hyperparameters (numbers stay numbers; (N,) tensors
    in the math dtype), read by ``Lion.update_``."""
    lr, wd = h["lr"], h["weight_decay"]
    v: dict[str, Any] = {"maximize": h["maximize"], "lr": lr}
    if isinstance(h["maximize"], Tensor):
        v["sign"] = torch.where(h["maximize"], -1.0, 1.0)
    v["decay"] = 1 - lr * wd if isinstance(wd, Tensor) or wd != 0 else None
    v["neg_lr"] = -lr
    v["keep1"] = 1 - h["beta1"]
    v["keep2"] = 1 - h["beta2"]
    return v
