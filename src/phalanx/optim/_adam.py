"""Adam and AdamW with per-member hyperparameters and per-member step counts."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from phalanx import _torch_compat as compat

from ._arith import math_dtype, powers
from ._base import KEEP_ELEMENTS, MemberOptimizer
from ._blocked import member_views, scaled_step
from ._generated import prefers_generated
from ._settings import PerMember, PerMemberFlag, Setting

__all__ = ["KEEP_ELEMENTS", "Adam", "AdamW", "adam_update", "adam_update_", "adam_values"]


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

    ``Adam.update`` (the pure form of ``adam_update_``, the one rule) on these arguments:
    what ``phalanx.compile_step`` traces. ``step`` is the (N,) count after this step's
    increment; each hyperparameter is a number or an (N,) tensor in the math dtype (bool for
    ``maximize``). The same operations, in the same order and precision, as torch.optim's
    single-tensor Adam, with (N, 1, ...) tensors where it has Python floats.

    Returns:
        "param", "exp_avg", "exp_avg_sq" and, with ``max_exp_avg_sq``, "max_exp_avg_sq".
    """
    state = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if max_exp_avg_sq is not None:
        state["max_exp_avg_sq"] = max_exp_avg_sq
    h = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    h["maximize"] = maximize
    amsgrad = max_exp_avg_sq is not None
    return Adam.update(p, g, state, h, amsgrad=amsgrad, decoupled=decoupled)


def adam_values(h: dict[str, Any], step: Tensor, *, decoupled: bool) -> dict[str, Any]:
    """The numbers the Adam rule derives from its hyperparameters and the (N,) counts (numbers
    stay numbers; (N,) tensors in the math dtype), read by ``adam_update_``."""
    lr, wd, maximize = h["lr"], h["weight_decay"], h["maximize"]
    v: dict[str, Any] = {"maximize": maximize, "eps": h["eps"], "beta2": h["beta2"]}
    if isinstance(maximize, Tensor):
        v["sign"] = torch.where(maximize, -1.0, 1.0)
    v["decoupled"] = v["coupled"] = None  # the weight decay: a factor of p, or of g's term
    if isinstance(wd, Tensor) or wd != 0:
        v["decoupled" if decoupled else "coupled"] = 1 - lr * wd if decoupled else wd
    v["keep1"] = 1 - h["beta1"]
    v["keep2"] = 1 - h["beta2"]
    # Bias corrections per member, in float64 as torch's Python floats: a member's count is
    # its own, and a parameter without a gradient in some steps has its own count, as in torch.
    step = step.to(math_dtype(step.device))  # float32 counts (fused kernels') in float64
    bias_correction1 = 1 - powers(h["beta1"], step)
    bias_correction2 = 1 - powers(h["beta2"], step)
    v["bias_correction2_sqrt"] = bias_correction2.sqrt()
    # lr / bias_correction1 as a tensor division: a Python float over a tensor is
    # torch's __rtruediv__, reciprocal(tensor) * float, which rounds differently from
    # torch.optim's float division (and from the per-member path's tensor division).
    if isinstance(lr, Tensor):
        lr_t = lr.to(bias_correction1.dtype)
    else:  # a fill, not a blocking host->device copy of a Python number
        lr_t = torch.full((), lr, dtype=bias_correction1.dtype, device=bias_correction1.device)
    v["step_size"] = -(lr_t / bias_correction1)
    return v


def adam_update_(
    p: Tensor,
    g: Tensor,
    state: dict[str, Tensor],
    v: dict[str, Any],
    scratch: tuple[Tensor, Tensor],
    *,
    amsgrad: bool,
) -> None:
    """The Adam(W) rule, written into ``p`` and ``state`` on a block: torch.optim's
    single-tensor Adam operation for operation, each with ``out=`` into its target or one of
    the two scratch buffers (``a`` holds the gradient as the rule steps against it, then the
    step; ``b`` the denominator). ``v``: ``adam_values`` cut to the block's rows, tensors
    (rows, 1) in ``p``'s dtype, as ``per_member`` casts them."""
    a, b = scratch
    maximize = v["maximize"]
    if isinstance(maximize, Tensor):
        g = torch.mul(g, v["sign"], out=a)
    elif maximize:
        g = torch.neg(g, out=a)
    if v["decoupled"] is not None:
        p.mul_(v["decoupled"])
    elif isinstance(v["coupled"], Tensor):
        g = torch.addcmul(g, p, v["coupled"], out=a)
    elif v["coupled"] is not None:  # rounded as torch's grad.add(param, alpha=weight_decay)
        g = torch.add(g, p, alpha=v["coupled"], out=a)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(g, v["keep1"])
    exp_avg_sq.mul_(v["beta2"])
    if isinstance(v["beta2"], Tensor):
        exp_avg_sq.addcmul_(torch.mul(g, v["keep2"], out=b), g)
    else:
        exp_avg_sq.addcmul_(g, g, value=v["keep2"])
    source = exp_avg_sq
    if amsgrad:
        source = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
    denom = torch.sqrt(source, out=b)
    denom.div_(v["bias_correction2_sqrt"])
    denom.add_(v["eps"])
    p.addcdiv_(torch.mul(exp_avg, v["step_size"], out=a), denom)


class Adam(MemberOptimizer):
    """Adam over stacked parameters, with every hyperparameter and the step count per member.

    Member i follows the trajectory of ``torch.optim.Adam`` run on member i alone with member
    i's hyperparameters: to float rounding by default, bit for bit with ``mode="torch"``.
    Each hyperparameter is a number shared by all members or a tensor of shape (N,), one
    value per member. The step count is (N,): a member masked out
    of a step keeps its count, so its bias correction stays its own.

    Args:
        params: stacked parameters, each of shape (N, *shape), or param group dicts.
        lr: learning rate, a number or (N,). See ``MemberOptimizer`` for how schedulers see it.
        betas: (beta1, beta2), each a number or (N,).
        eps: term added to the denominator, a number or (N,).
        weight_decay: L2 penalty added to the gradient (Adam) or decoupled decay (AdamW), a
            number or (N,).
        amsgrad: use the AMSGrad variant (one bool for all members).
        maximize: maximize the objective, a bool or (N,) bool tensor.
        skip_nonfinite: skip members whose loss or gradients are not finite in a step, and
            warn which (see ``MemberOptimizer``).
        freeze_after: with ``skip_nonfinite``, freeze a member after this many skipped steps.
        warn_skipped: warn (one host sync per step) when members are skipped.
        mode: which bits each member gets: "fast" (the default, to float rounding at
            torch's fused speed), "torch" (torch.optim.Adam's single-tensor arithmetic, bit
            for bit) or "fused" (torch.optim.Adam(fused=True), bit for bit); see
            ``MemberOptimizer``, "Modes".
        fused: ``fused=True`` is ``mode="fused"`` (the older keyword).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(3, 2))  # 3 members
        >>> opt = Adam([w], lr=torch.tensor([0.1, 0.01, 0.001]))
        >>> w.grad = torch.ones(3, 2)
        >>> opt.step()
        >>> w[:, 0]
        tensor([-0.1000, -0.0100, -0.0010], grad_fn=<SelectBackward0>)
    """

    SETTINGS = (
        Setting("lr", "rate"),
        Setting("betas", "unit", parts=("beta1", "beta2"), momentum=True),
        Setting("eps", "nonneg"),
        Setting("weight_decay", "nonneg"),
        Setting("amsgrad", "option"),
        Setting("maximize", "flag"),
    )
    REALIZE = ("bias_correction2_sqrt", "step_size")  # per member, from pow
    _DECOUPLED = False

    def __init__(
        self,
        params: Any,
        lr: PerMember = 1e-3,
        betas: tuple[PerMember, PerMember] = (0.9, 0.999),
        eps: PerMember = 1e-8,
        weight_decay: PerMember = 0.0,
        amsgrad: bool = False,
        *,
        maximize: PerMemberFlag = False,
        skip_nonfinite: bool = False,
        freeze_after: int | None = None,
        warn_skipped: bool = True,
        fused: bool = False,
        mode: str | None = None,
    ) -> None:
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
            mode=mode,
            fused=fused,
        )

    def options(self, group: dict[str, Any]) -> dict[str, Any]:
        return {**super().options(group), "decoupled": self._DECOUPLED}

    @staticmethod
    def state_names(**options: Any) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if options["amsgrad"] else ())

    @staticmethod
    def values(
        h: dict[str, Any], step: Tensor, started: frozenset[str], **options: Any
    ) -> dict[str, Any]:
        return adam_values(h, step, decoupled=options["decoupled"])

    @staticmethod
    def update_(
        p: Tensor,
        g: Tensor,
        state: dict[str, Tensor],
        v: dict[str, Any],
        scratch: tuple[Tensor, Tensor],
        **options: Any,
    ) -> None:
        adam_update_(p, g, state, v, scratch, amsgrad=options["amsgrad"])

    FAST = True

    def fast_update(
        self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], counts: list[int]
    ) -> None:
        """torch's fused Adam(W) kernel once on the whole stacked tensors: every member shares
        the numbers and each parameter's count, so one count per tensor is each member's."""
        kernel = compat.fused_adamw_ if self._DECOUPLED else compat.fused_adam_
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        compat.foreach_add_(steps, 1)
        betas = group["betas"]

        def run(
            ts: dict[str, list[Tensor]], count: list[Tensor], lr: float, wd: float, flip: bool
        ) -> None:  # flip: the gradient was negated already
            kernel(
                ts["param"],
                ts["grad"],
                ts["exp_avg"],
                ts["exp_avg_sq"],
                ts["max_exp_avg_sq"] if group["amsgrad"] else [],
                count,
                amsgrad=bool(group["amsgrad"]),
                lr=lr,
                beta1=float(betas[0]),
                beta2=float(betas[1]),
                weight_decay=wd,
                eps=float(group["eps"]),
                maximize=bool(group["maximize"]) and not flip,
            )

        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        shared = [s[0] for s in steps]  # member 0's count is every member's (float32, as torch's)
        if group["member_lr"] is None:
            whole = {"param": params, "grad": grads, **{k: [s[k] for s in states] for k in keys}}
            run(whole, shared, float(group["lr"]), float(group["weight_decay"]), False)
            return
        # Per-member rates: torch's kernel with rate 1 into scratch, scaled per member
        # (_blocked.scaled_step). Adam's decay, added to the gradient from the parameter, is
        # added on the block first: the kernel sees the scratch block, not the parameter.
        wd = float(group["weight_decay"])
        coupled = 0.0 if self._DECOUPLED else wd
        flip = bool(group["maximize"]) and coupled != 0  # the prepass negates the gradient

        def block(ts: dict[str, list[Tensor]], count: list[Tensor]) -> None:
            run(ts, count, 1.0, 0.0, flip)

        decoupled = wd if self._DECOUPLED else 0.0
        scaled_step(
            self,
            group,
            params,
            grads,
            keys,
            block,
            coupled=coupled,
            decoupled=decoupled,
            maximize=flip,
        )

    def fast_takes(self, group: dict[str, Any]) -> bool:
        """Per-member rates too (``_blocked.scaled_step``), but not for large members (their
        views, ``_blocked.member_views``) or a large stack (``_generated``): both faster."""
        if group["member_lr"] is None:
            return True
        stepped = [p for p in group["params"] if p.grad is not None]
        return not (member_views(self, group, stepped) or prefers_generated(group))

    def fused_update(
        self,
        group: dict[str, Any],
        members: list[int],
        params: list[Tensor],
        grads: list[Tensor],
        values: dict[str, Any],
    ) -> None:
        kernel = compat.fused_adamw_ if self._DECOUPLED else compat.fused_adam_
        states = [self.state[p] for p in params]

        def views(tensors: list[Tensor]) -> list[Tensor]:
            return [rows[i] for rows in map(self._kept_rows, tensors) for i in members]

        kernel(
            views(params),
            [g[i] for g in grads for i in members],  # new every step: not kept
            views([s["exp_avg"] for s in states]),
            views([s["exp_avg_sq"] for s in states]),
            views([s["max_exp_avg_sq"] for s in states]) if group["amsgrad"] else [],
            views([s["step"] for s in states]),
            amsgrad=bool(group["amsgrad"]),
            lr=float(values["lr"]),
            beta1=float(values["beta1"]),
            beta2=float(values["beta2"]),
            weight_decay=float(values["weight_decay"]),
            eps=float(values["eps"]),
            maximize=bool(values["maximize"]),
        )


class AdamW(Adam):
    """AdamW (decoupled weight decay) over stacked parameters, every hyperparameter per member.

    Member i follows the trajectory of ``torch.optim.AdamW`` run on member i alone with member
    i's hyperparameters (to float rounding by default, bit for bit with ``mode="torch"``).
    Arguments as ``Adam``; ``weight_decay`` defaults to 1e-2 and
    multiplies the weights by ``1 - lr * weight_decay`` before the Adam update.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2, 2))
        >>> opt = AdamW([w], lr=0.1, weight_decay=torch.tensor([0.0, 1.0]))
        >>> w.grad = torch.zeros(2, 2)
        >>> opt.step()
        >>> w[:, 0]
        tensor([1.0000, 0.9000], grad_fn=<SelectBackward0>)
    """

    _DECOUPLED = True

    def __init__(
        self,
        params: Any,
        lr: PerMember = 1e-3,
        betas: tuple[PerMember, PerMember] = (0.9, 0.999),
        eps: PerMember = 1e-8,
        weight_decay: PerMember = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: PerMemberFlag = False,
        skip_nonfinite: bool = False,
        freeze_after: int | None = None,
        warn_skipped: bool = True,
        fused: bool = False,
        mode: str | None = None,
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
            mode=mode,
        )
