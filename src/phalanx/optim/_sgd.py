"""Stochastic gradient descent with per-member hyperparameters."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from phalanx import _torch_compat as compat

from ._base import MemberOptimizer, axpy, math_dtype, rows, signed, views

__all__ = ["SGD"]


class SGD(MemberOptimizer):
    """SGD over stacked parameters, with every hyperparameter per member.

    Member i follows exactly the trajectory of `torch.optim.SGD` run on member i alone with
    member i's hyperparameters. Each hyperparameter is a number shared by all members or a
    tensor of shape (N,), one value per member.

    Args:
        params: stacked parameters, each of shape (N, *shape), or param group dicts.
        lr: learning rate, a number or (N,). See `MemberOptimizer` for how schedulers see it.
        momentum: momentum factor, a number or (N,).
        dampening: dampening of the momentum, a number or (N,).
        weight_decay: L2 penalty, a number or (N,).
        nesterov: Nesterov momentum, a bool or (N,) bool tensor.
        maximize: maximize the objective, a bool or (N,) bool tensor.
        skip_nonfinite: skip members whose loss or gradients are not finite in a step, and
            warn which (see `MemberOptimizer`).
        freeze_after: with `skip_nonfinite`, freeze a member after this many skipped steps.
        warn_skipped: warn (one host sync per step) when members are skipped.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4, 3))  # 4 members
        >>> opt = SGD([w], lr=torch.tensor([0.1, 0.2, 0.3, 0.4]), momentum=0.9)
        >>> w.grad = torch.ones(4, 3)
        >>> opt.step(mask=torch.tensor([True, True, True, False]))
        >>> w[:, 0]
        tensor([0.9000, 0.8000, 0.7000, 1.0000], grad_fn=<SelectBackward0>)
    """

    _HYPER = (
        ("momentum", "nonneg"),
        ("dampening", "nonneg"),
        ("weight_decay", "nonneg"),
        ("nesterov", "bool"),
        ("maximize", "bool"),
    )
    _NAME = "phalanx.optim.SGD"

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        momentum: float | Tensor = 0.0,
        dampening: float | Tensor = 0.0,
        weight_decay: float | Tensor = 0.0,
        nesterov: bool | Tensor = False,
        *,
        maximize: bool | Tensor = False,
        skip_nonfinite: bool = False,
        freeze_after: int | None = None,
        warn_skipped: bool = True,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
        }
        super().__init__(
            params,
            defaults,
            skip_nonfinite=skip_nonfinite,
            freeze_after=freeze_after,
            warn_skipped=warn_skipped,
        )

    def _check_group(self, group: dict[str, Any], where: str | None = None) -> None:
        """Nesterov members need momentum and zero dampening."""
        nesterov = torch.as_tensor(group["nesterov"]).cpu().expand(self.num_members)
        momentum = torch.as_tensor(group["momentum"]).cpu().expand(self.num_members)
        dampening = torch.as_tensor(group["dampening"]).cpu().expand(self.num_members)
        bad = nesterov & ((momentum <= 0) | (dampening != 0))
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"{where or self._NAME + '()'}: member {k} uses Nesterov momentum with momentum="
                f"{momentum[k].item()} and dampening={dampening[k].item()}; Nesterov momentum "
                "needs momentum > 0 and dampening = 0."
            )

    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        state["step"] = torch.zeros(self.num_members, dtype=math_dtype(p.device), device=p.device)
        momentum = group["momentum"]
        if isinstance(momentum, Tensor) or momentum != 0:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> None:
        device = params[0].device
        steps = [self.state[p]["step"] for p in params]
        compat.foreach_add_(steps, 1)
        grads = signed(grads, self._values(group["maximize"], device))
        weight_decay = self._values(group["weight_decay"], device)
        if isinstance(weight_decay, Tensor) or weight_decay != 0:
            grads = axpy(grads, params, views(weight_decay, params))

        momentum = self._values(group["momentum"], device)
        if isinstance(momentum, Tensor) or momentum != 0:
            dtype = steps[0].dtype
            momentum = torch.as_tensor(momentum, dtype=dtype, device=device)
            dampening = self._values(group["dampening"], device)
            keep = 1 - torch.as_tensor(dampening, dtype=dtype, device=device)
            # torch starts a buffer as a copy of the gradient (and uses the bare gradient
            # when momentum is 0): a zero buffer, decay 0 and gradient weight 1 give the same
            # bits. fresh: (P, N), per parameter and member.
            fresh = (torch.stack(steps) == 1) | (momentum == 0)
            for j, p in enumerate(params):
                if "momentum_buffer" not in self.state[p]:
                    # momentum was 0 until now (a scheduler): the buffer starts for everyone
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                    fresh[j] = True
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            compat.foreach_mul_(bufs, rows(torch.where(fresh, 0.0, momentum), bufs))
            compat.foreach_addcmul_(bufs, grads, rows(torch.where(fresh, 1.0, keep), bufs))
            nesterov = self._values(group["nesterov"], device)
            if isinstance(nesterov, Tensor):
                ahead = axpy(grads, bufs, views(momentum, bufs))
                flags = views(nesterov, bufs)
                grads = [torch.where(f, a, b) for f, a, b in zip(flags, ahead, bufs, strict=True)]
            elif nesterov:
                grads = axpy(grads, bufs, views(momentum, bufs))
            else:
                grads = bufs

        lr = self._lr(group, device)
        if isinstance(lr, Tensor):
            compat.foreach_addcmul_(params, grads, views(-lr, params))
        else:
            compat.foreach_add_(params, grads, alpha=-lr)
