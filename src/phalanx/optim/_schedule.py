"""A learning-rate schedule per member."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._base import MemberOptimizer

__all__ = ["MemberLambdaLR"]


class MemberLambdaLR:
    """Sets each member's learning rate to its initial rate times `lr_lambda(epoch)[i]`.

    It writes `group["member_lr"]` and never `group["lr"]`, so it composes with any torch LR
    scheduler on the same optimizer: member i's rate is then
    `torch_schedule_factor * initial_member_lr[i] * lr_lambda(epoch)[i]`.

    Args:
        optimizer: a phalanx optimizer.
        lr_lambda: maps the epoch (an int, counted by `step()`) to an (N,) tensor of factors,
            or to a number for all members.
        last_epoch: the index of the last epoch, -1 to start.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(3, 2))
        >>> opt = phalanx.optim.SGD([w], lr=0.1)
        >>> warmup = torch.tensor([1.0, 2.0, 4.0])  # epochs of linear warm-up, per member
        >>> sched = MemberLambdaLR(opt, lambda e: torch.clamp((e + 1) / warmup, max=1.0))
        >>> opt.param_groups[0]["member_lr"]
        tensor([1.0000, 0.5000, 0.2500])
    """

    def __init__(
        self,
        optimizer: MemberOptimizer,
        lr_lambda: Callable[[int], Tensor | float],
        last_epoch: int = -1,
    ) -> None:
        if not isinstance(optimizer, MemberOptimizer):
            raise TypeError(
                "phalanx.optim.MemberLambdaLR(): expected a phalanx optimizer "
                f"(phalanx.optim.SGD, Adam or AdamW); got {type(optimizer).__name__}."
            )
        self.optimizer = optimizer
        self.lr_lambda = lr_lambda
        self.last_epoch = last_epoch
        n = optimizer.num_members
        device = optimizer.frozen.device
        self.base_member_lrs = [
            torch.ones(n, dtype=torch.float64, device=device)
            if group["member_lr"] is None
            else group["member_lr"].detach().to(device, torch.float64).expand(n).clone()
            for group in optimizer.param_groups
        ]
        optimizer._attach_schedule(self)  # member surgery moves base_member_lrs' rows
        self.step()

    def _keep_members(self, index: Tensor) -> None:
        """Follows `optimizer.keep_members`: each group's base rates keep rows `index`."""
        self.base_member_lrs = [base[index.to(base.device)] for base in self.base_member_lrs]

    def _copy_members(self, src: Tensor, dst: Tensor) -> None:
        """Follows `optimizer.copy_members`: each target takes its source's base rate."""
        for base in self.base_member_lrs:
            base[dst.to(base.device)] = base[src.to(base.device)]

    def step(self) -> None:
        """Advances one epoch and writes every group's `member_lr`."""
        self.last_epoch += 1
        factor = torch.as_tensor(self.lr_lambda(self.last_epoch), dtype=torch.float64)
        n = self.optimizer.num_members
        if factor.shape not in {(), (n,)}:
            raise ValueError(
                f"phalanx.optim.MemberLambdaLR.step(): lr_lambda({self.last_epoch}) returned "
                f"shape {tuple(factor.shape)}; expected a number or shape ({n},)."
            )
        for group, base in zip(self.optimizer.param_groups, self.base_member_lrs, strict=True):
            group["member_lr"] = base * factor.to(base.device)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and initial rates; `lr_lambda` is code, so it is not saved."""
        return {"last_epoch": self.last_epoch, "base_member_lrs": list(self.base_member_lrs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the epoch and initial rates saved by `state_dict`."""
        self.last_epoch = int(state_dict["last_epoch"])
        device = self.optimizer.frozen.device
        self.base_member_lrs = [t.to(device, torch.float64) for t in state_dict["base_member_lrs"]]
