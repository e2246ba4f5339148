"""Adam and AdamW with per-member hyperparameters and per-member step counts."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from phalanx import _torch_compat as compat

from ._base import MemberOptimizer, math_dtype, per_member

__all__ = ["Adam", "AdamW", "adam_update"]


def adam_update(
    p: Tensor,
    g: Tensor,
    step: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    *,
    lr: float | Tensor,
    beta1: float | Tensor,
    beta2: float | Tensor,
    eps: float | Tensor,
    weight_decay: float | Tensor,
    maximize: float | Tensor,
    decoupled: bool,
) -> dict[str, Tensor]:
    """One Adam(W) update of a stacked parameter: its new value and state, nothing written.

    The one rule: ``phalanx.optim.Adam`` runs it eagerly and writes the results in place;
    ``phalanx.compile_step`` traces it into its graph, so the captured update is this
    function, not a copy of it. ``step`` is the (N,) count after this step's increment; each
    hyperparameter is a number or an (N,) tensor in the math dtype (bool for ``maximize``).
    The same operations, in the same order and precision, as torch.optim's single-tensor
    Adam, with (N, 1, ...) tensors where it has Python floats.

    Returns:
        "param", "exp_avg", "exp_avg_sq" and, with ``max_exp_avg_sq``, "max_exp_avg_sq".
    """
    if isinstance(maximize, Tensor):
        g = g * per_member(torch.where(maximize, -1.0, 1.0), g)  # g * -1 is exactly -g
    elif maximize:
        g = -g
    if isinstance(weight_decay, Tensor) or weight_decay != 0:
        if decoupled:
            p = p * per_member(1 - lr * weight_decay, p)
        elif isinstance(weight_decay, Tensor):
            g = torch.addcmul(g, p, per_member(weight_decay, p))
        else:  # rounded as torch's grad.add(param, alpha=weight_decay): one fused multiply-add
            g = g.add(p, alpha=weight_decay)
    exp_avg = torch.lerp(exp_avg, g, per_member(1 - beta1, g))
    exp_avg_sq = exp_avg_sq * per_member(beta2, g)
    if isinstance(beta2, Tensor):
        # addcmul's value must be a number: fold (1 - beta2) into the first factor, which
        # rounds the same as torch's value * grad * grad.
        exp_avg_sq = torch.addcmul(exp_avg_sq, g * per_member(1 - beta2, g), g)
    else:
        exp_avg_sq = torch.addcmul(exp_avg_sq, g, g, value=1 - beta2)
    new = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if max_exp_avg_sq is not None:
        new["max_exp_avg_sq"] = torch.maximum(max_exp_avg_sq, exp_avg_sq)
        denom = new["max_exp_avg_sq"].sqrt()
    else:
        denom = exp_avg_sq.sqrt()
    # Bias corrections per member, in float64 as torch's Python floats: a member's count is
    # its own, and a parameter without a gradient in some steps has its own count, as in torch.
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = denom / per_member(bias_correction2.sqrt(), p)
    denom = denom + per_member(eps, denom)
    # lr / bias_correction1 as a tensor division: a Python float over a tensor is
    # torch's __rtruediv__, reciprocal(tensor) * float, which rounds differently from
    # torch.optim's float division (and from the per-member path's tensor division).
    lr_t = torch.as_tensor(lr, dtype=bias_correction1.dtype, device=bias_correction1.device)
    new["param"] = torch.addcdiv(p, exp_avg * per_member(-(lr_t / bias_correction1), p), denom)
    return new


class Adam(MemberOptimizer):
    """Adam over stacked parameters, with every hyperparameter and the step count per member.

    Member i follows exactly the trajectory of `torch.optim.Adam` run on member i alone with
    member i's hyperparameters. Each hyperparameter is a number shared by all members or a
    tensor of shape (N,), one value per member. The step count is (N,): a member masked out
    of a step keeps its count, so its bias correction stays its own.

    Args:
        params: stacked parameters, each of shape (N, *shape), or param group dicts.
        lr: learning rate, a number or (N,). See `MemberOptimizer` for how schedulers see it.
        betas: (beta1, beta2), each a number or (N,).
        eps: term added to the denominator, a number or (N,).
        weight_decay: L2 penalty added to the gradient (Adam) or decoupled decay (AdamW), a
            number or (N,).
        amsgrad: use the AMSGrad variant (one bool for all members).
        maximize: maximize the objective, a bool or (N,) bool tensor.
        skip_nonfinite: skip members whose loss or gradients are not finite in a step, and
            warn which (see `MemberOptimizer`).
        freeze_after: with `skip_nonfinite`, freeze a member after this many skipped steps.
        warn_skipped: warn (one host sync per step) when members are skipped.
        fused: on the CPU, run torch's fused Adam kernel when every hyperparameter has one
            value for all members and the step counts agree: one pass over memory instead of
            eight (3.5x faster on W4's 8.6M parameters per tensor), but then each member
            equals torch.optim to float rounding only, and its bits depend on the number of
            members and on masks elsewhere. Off by default: bit for bit.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(3, 2))  # 3 members
        >>> opt = Adam([w], lr=torch.tensor([0.1, 0.01, 0.001]))
        >>> w.grad = torch.ones(3, 2)
        >>> opt.step()
        >>> w[:, 0]
        tensor([-0.1000, -0.0100, -0.0010], grad_fn=<SelectBackward0>)
    """

    _HYPER = (
        ("betas", "unit"),
        ("eps", "nonneg"),
        ("weight_decay", "nonneg"),
        ("amsgrad", "bool"),
        ("maximize", "bool"),
    )
    _NAME = "phalanx.optim.Adam"
    _DECOUPLED = False

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float | Tensor = 1e-8,
        weight_decay: float | Tensor = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool | Tensor = False,
        skip_nonfinite: bool = False,
        freeze_after: int | None = None,
        warn_skipped: bool = True,
        fused: bool = False,
    ) -> None:
        self.fused = bool(fused)
        if isinstance(amsgrad, Tensor):
            raise ValueError(
                f"{self._NAME}(): amsgrad must be one bool for all members; got a tensor."
            )
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
        }
        super().__init__(
            params,
            defaults,
            skip_nonfinite=skip_nonfinite,
            freeze_after=freeze_after,
            warn_skipped=warn_skipped,
        )

    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        state["step"] = torch.zeros(self.num_members, dtype=math_dtype(p.device), device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> None:
        # The same operations, in the same order and precision, as torch.optim's
        # single-tensor Adam, with (N, 1, ...) tensors where it has Python floats: one path
        # for every case, shared numbers and per-member tensors alike. torch's fused Adam
        # kernel runs only when asked for (fused=True): its vectorised body and scalar tail
        # round differently, so a member's bits would depend on its offset in the stack
        # (on N) and on whether another member was masked.
        device = params[0].device
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        compat.foreach_add_(steps, 1)
        if self._fused_kernel_applies(group, steps):
            self._fused_update(group, params, grads, steps, exp_avgs, exp_avg_sqs)
            return
        counts = self._shared_counts(group, steps)
        if counts is not None:
            self._shared_update(group, params, grads, counts, exp_avgs, exp_avg_sqs)
            return
        hypers = {
            "lr": self._lr(group, device),
            "beta1": self._values(group["betas"][0], device),
            "beta2": self._values(group["betas"][1], device),
            "eps": self._values(group["eps"], device),
            "weight_decay": self._values(group["weight_decay"], device),
            "maximize": self._values(group["maximize"], device),
        }
        for p, g, state in zip(params, grads, states):
            new = adam_update(
                p,
                g,
                state["step"],
                state["exp_avg"],
                state["exp_avg_sq"],
                state["max_exp_avg_sq"] if group["amsgrad"] else None,
                **hypers,
                decoupled=self._DECOUPLED,
            )
            p.copy_(new.pop("param"))
            for key, value in new.items():
                state[key].copy_(value)

    def member_hyperparameters(
        self, group: dict[str, Any], device: torch.device
    ) -> dict[str, Tensor]:
        """A group's hyperparameters as (N,) tensors in the math dtype, as ``adam_update`` takes
        them (the captured step feeds them to its graph as inputs)."""

        def full(value: float | Tensor) -> Tensor:
            if isinstance(value, Tensor):
                return value.contiguous()
            return torch.full((self.num_members,), value, dtype=math_dtype(device), device=device)

        maximize = self._values(group["maximize"], device)
        return {
            "lr": full(self._lr(group, device)),
            "beta1": full(self._values(group["betas"][0], device)),
            "beta2": full(self._values(group["betas"][1], device)),
            "eps": full(self._values(group["eps"], device)),
            "weight_decay": full(self._values(group["weight_decay"], device)),
            "maximize": maximize
            if isinstance(maximize, Tensor)
            else torch.full((self.num_members,), bool(maximize), device=device),
        }

    def _shared_counts(self, group: dict[str, Any], steps: list[Tensor]) -> list[float] | None:
        """Each parameter's step count when every member shares it and every hyperparameter
        is one number, on the CPU (elsewhere reading the counts would cost a sync): then the
        update below runs torch.optim's own operations with its own Python numbers."""
        scalars = [group["lr"], *group["betas"], group["eps"], group["weight_decay"]]
        if group["member_lr"] is not None or group["amsgrad"]:
            return None
        if any(isinstance(v, Tensor) for v in [*scalars, group["maximize"]]):
            return None
        if steps[0].device.type != "cpu":
            return None
        step = torch.stack(steps)  # (P, N)
        if not bool((step == step[:, :1]).all()):
            return None  # a masked or skipped member has its own count
        return step[:, 0].tolist()

    def _shared_update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        counts: list[float],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
    ) -> None:
        """torch.optim's single-tensor Adam, operation for operation and number for number,
        on whole stacked tensors (elementwise, so each member's bits are its own whatever N):
        the general path's (N, 1, ...) hyperparameter tensors and float64 bias corrections
        cost about 2.5x the time (W4: 33 ms against 13 ms a step) for the same bits."""
        lr, (beta1, beta2) = float(group["lr"]), (float(b) for b in group["betas"])
        eps, weight_decay = float(group["eps"]), float(group["weight_decay"])
        if group["maximize"]:
            grads = list(compat.foreach_neg(grads))
        if weight_decay != 0:
            if self._DECOUPLED:
                compat.foreach_mul_(params, 1 - lr * weight_decay)
            else:
                grads = list(compat.foreach_add(grads, params, alpha=weight_decay))
        compat.foreach_lerp_(exp_avgs, grads, 1 - beta1)
        compat.foreach_mul_(exp_avg_sqs, beta2)
        compat.foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        for p, m, v, step in zip(params, exp_avgs, exp_avg_sqs, counts):
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            step_size = lr / bias_correction1
            denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)

    def _fused_kernel_applies(self, group: dict[str, Any], steps: list[Tensor]) -> bool:
        """True when `fused=True` was asked for and torch's fused Adam kernel can run this
        step on the CPU: one value of every hyperparameter for all members and one step count
        per parameter (a mask or a skipped member makes the counts differ). On CUDA the check
        would cost a synchronisation, so the exact path runs there.
        """
        if not self.fused:
            return False
        scalars = [group["lr"], *group["betas"], group["eps"], group["weight_decay"]]
        if group["member_lr"] is not None or any(isinstance(v, Tensor) for v in scalars):
            return False
        if isinstance(group["maximize"], Tensor) or steps[0].device.type != "cpu":
            return False
        step = torch.stack(steps)
        return bool((step == step[:, :1]).all())

    def _fused_update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        steps: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
    ) -> None:
        states = [self.state[p] for p in params]
        kernel = compat.fused_adamw_ if self._DECOUPLED else compat.fused_adam_
        beta1, beta2 = group["betas"]
        kernel(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [],
            [s[0] for s in steps],  # the members' common count, as a 0-d view
            amsgrad=group["amsgrad"],
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
            maximize=bool(group["maximize"]),
        )


class AdamW(Adam):
    """AdamW (decoupled weight decay) over stacked parameters, every hyperparameter per member.

    Member i follows exactly the trajectory of `torch.optim.AdamW` run on member i alone with
    member i's hyperparameters. Arguments as `Adam`; `weight_decay` defaults to 1e-2 and
    multiplies the weights by `1 - lr * weight_decay` before the Adam update.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2, 2))
        >>> opt = AdamW([w], lr=0.1, weight_decay=torch.tensor([0.0, 1.0]))
        >>> w.grad = torch.zeros(2, 2)
        >>> opt.step()
        >>> w[:, 0]
        tensor([1.0000, 0.9000], grad_fn=<SelectBackward0>)
    """

    _NAME = "phalanx.optim.AdamW"
    _DECOUPLED = True

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float | Tensor = 1e-8,
        weight_decay: float | Tensor = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool | Tensor = False,
        skip_nonfinite: bool = False,
        freeze_after: int | None = None,
        warn_skipped: bool = True,
        fused: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            skip_nonfinite=skip_nonfinite,
            freeze_after=freeze_after,
            warn_skipped=warn_skipped,
            fused=fused,
        )
