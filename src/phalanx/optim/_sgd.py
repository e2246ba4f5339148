"""Stochastic gradient descent with per-member hyperparameters."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from phalanx import _torch_compat as compat

from ._arith import math_dtype
from ._base import MemberOptimizer
from ._blocked import member_views, scaled_step
from ._generated import prefers_generated
from ._settings import PerMember, PerMemberFlag, Setting

__all__ = ["SGD"]


class SGD(MemberOptimizer):
    """SGD over stacked parameters, with every hyperparameter per member.

    Member i follows the trajectory of ``torch.optim.SGD`` run on member i alone with member
    i's hyperparameters: to float rounding by default, bit for bit with ``mode="torch"``.
    Each hyperparameter is a number shared by all members or a tensor of shape (N,), one
    value per member.

    Args:
        params: stacked parameters, each of shape (N, *shape), or param group dicts.
        lr: learning rate, a number or (N,). See ``MemberOptimizer`` for how schedulers see it.
        momentum: momentum factor, a number or (N,).
        dampening: dampening of the momentum, a number or (N,).
        weight_decay: L2 penalty, a number or (N,).
        nesterov: Nesterov momentum, a bool or (N,) bool tensor.
        maximize: maximize the objective, a bool or (N,) bool tensor.
        skip_nonfinite: skip members whose loss or gradients are not finite in a step, and
            warn which (see ``MemberOptimizer``).
        freeze_after: with ``skip_nonfinite``, freeze a member after this many skipped steps.
        warn_skipped: warn (one host sync per step) when members are skipped.
        mode: which bits each member gets: "fast" (the default, to float rounding at
            torch's fused speed), "torch" (torch.optim.SGD's single-tensor arithmetic, bit
            for bit) or "fused" (torch.optim.SGD(fused=True), bit for bit); see
            ``MemberOptimizer``, "Modes".
        fused: ``fused=True`` is ``mode="fused"`` (the older keyword).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4, 3))  # 4 members
        >>> opt = SGD([w], lr=torch.tensor([0.1, 0.2, 0.3, 0.4]), momentum=0.9)
        >>> w.grad = torch.ones(4, 3)
        >>> opt.step(mask=torch.tensor([True, True, True, False]))
        >>> w[:, 0]
        tensor([0.9000, 0.8000, 0.7000, 1.0000], grad_fn=<SelectBackward0>)
    """

    SETTINGS = (
        Setting("lr", "rate"),
        Setting("momentum", "nonneg", momentum=True),
        Setting("dampening", "nonneg"),
        Setting("weight_decay", "nonneg"),
        Setting("nesterov", "flag"),
        Setting("maximize", "flag"),
    )

    def __init__(
        self,
        params: Any,
        lr: PerMember = 1e-3,
        momentum: PerMember = 0.0,
        dampening: PerMember = 0.0,
        weight_decay: PerMember = 0.0,
        nesterov: PerMemberFlag = False,
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
            mode=mode,
            fused=fused,
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

    def options(self, group: dict[str, Any]) -> dict[str, Any]:
        momentum = group["momentum"]
        return {"momentum": isinstance(momentum, Tensor) or momentum != 0}

    @staticmethod
    def state_names(**options: Any) -> tuple[str, ...]:
        return ("momentum_buffer",) if options["momentum"] else ()

    @staticmethod
    def values(
        h: dict[str, Any], step: Tensor, started: frozenset[str], **options: Any
    ) -> dict[str, Any]:
        fresh = "momentum_buffer" in started
        return sgd_values(h, step, momentum=options["momentum"], fresh=fresh)

    @staticmethod
    def update_(
        p: Tensor,
        g: Tensor,
        state: dict[str, Tensor],
        v: dict[str, Any],
        scratch: tuple[Tensor, Tensor],
        **options: Any,
    ) -> None:
        """torch.optim.SGD's single-tensor step on a block, operation for operation (``a``:
        the gradient as the rule steps against it; ``b``: Nesterov's look-ahead)."""
        a, b = scratch
        maximize, weight_decay, lr = v["maximize"], v["weight_decay"], v["lr"]
        if isinstance(maximize, Tensor):
            g = torch.mul(g, v["sign"], out=a)
        elif maximize:
            g = torch.neg(g, out=a)
        if isinstance(weight_decay, Tensor):
            g = torch.addcmul(g, p, weight_decay, out=a)
        elif weight_decay != 0:  # rounded as torch's grad.add(param, alpha=weight_decay)
            g = torch.add(g, p, alpha=weight_decay, out=a)
        if options["momentum"]:
            # torch starts a buffer as a copy of the gradient (and uses the bare gradient
            # when momentum is 0): a zero buffer, decay 0 and gradient weight 1 give the
            # same bits (``sgd_values``).
            buf = state["momentum_buffer"]
            buf.mul_(v["decay"])
            buf.addcmul_(g, v["weight"])
            nesterov = v["nesterov"]
            if isinstance(nesterov, Tensor):
                ahead = torch.addcmul(g, buf, v["momentum"], out=b)
                g = torch.where(nesterov, ahead, buf, out=b)
            elif nesterov:
                g = torch.addcmul(g, buf, v["momentum"], out=b)
            else:
                g = buf
        if isinstance(lr, Tensor):
            p.addcmul_(g, lr)
        else:
            p.add_(g, alpha=-lr)

    FAST = True

    def fast_update(
        self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], counts: list[int]
    ) -> None:
        """torch's fused SGD kernel once (twice if some parameters take their first step) on
        the whole stacked tensors: every member shares the numbers and each parameter's count.
        With per-member rates, the kernel with rate 1 into scratch, scaled per member
        (``_blocked.scaled_step``)."""
        momentum = float(group["momentum"])
        calls: dict[bool, tuple[list[Tensor], list[Tensor], list[Tensor]]] = {}
        for p, g, count in zip(params, grads, counts, strict=True):
            state = self.state[p]
            first = False
            if momentum != 0:
                if "momentum_buffer" not in state:  # momentum set since: starts now, as torch's
                    state["momentum_buffer"] = torch.zeros_like(p)
                    first = True
                first = first or count == 0
            ps, gs, bufs = calls.setdefault(first, ([], [], []))
            ps.append(p)
            gs.append(g)
            if momentum != 0:
                bufs.append(state["momentum_buffer"])
        if group["member_lr"] is None:
            _fused_sgd_calls(calls, momentum, group)
        else:  # the kernel with rate 1 and no decay (added on the block first) into scratch
            wd, flip = float(group["weight_decay"]), bool(group["maximize"])
            values = {**group, "lr": 1.0, "weight_decay": 0.0, "maximize": False}
            keys = ["momentum_buffer"] if momentum != 0 else []
            for first, (ps, gs, _) in calls.items():

                def run(
                    ts: dict[str, list[Tensor]], count: list[Tensor], first: bool = first
                ) -> None:
                    step = {first: (ts["param"], ts["grad"], ts["momentum_buffer"])}
                    _fused_sgd_calls(step, momentum, values)

                kernel = run if momentum != 0 else None  # without momentum: the gradient
                scaled_step(self, group, ps, gs, keys, kernel, coupled=wd, maximize=flip)
        compat.foreach_add_([self.state[p]["step"] for p in params], 1)

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
        # torch's kernel takes one is_first_step per call: a member's first step copies the
        # gradient into its buffer. Members (and parameters) split by it.
        momentum = float(values["momentum"])
        calls: dict[bool, tuple[list[Tensor], list[Tensor], list[Tensor]]] = {}
        shared = self.__dict__.get("_step_counts")  # before this step, where members share them
        if shared is None:  # one host read of every parameter's counts (after this step's)
            table = torch.stack([self.state[p]["step"] for p in params]).tolist()
        for j, (p, g) in enumerate(zip(params, grads, strict=True)):
            state = self.state[p]
            steps = [shared[j] + 1] * self.num_members if shared is not None else table[j]
            if momentum != 0 and "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            p_rows = self._kept_rows(p)
            buf_rows = self._kept_rows(state["momentum_buffer"]) if momentum != 0 else []
            for i in members:
                first = momentum != 0 and steps[i] == 1
                ps, gs, bufs = calls.setdefault(first, ([], [], []))
                ps.append(p_rows[i])
                gs.append(g[i])  # new every step: not kept
                if momentum != 0:
                    bufs.append(buf_rows[i])
        _fused_sgd_calls(calls, momentum, values)


def _fused_sgd_calls(
    calls: dict[bool, tuple[list[Tensor], list[Tensor], list[Tensor]]],
    momentum: float,
    values: dict[str, Any],
) -> None:
    """torch's fused SGD kernel, once per ``is_first_step`` value (a first step copies the
    gradient into the momentum buffer): the tensors ``calls`` groups by it."""
    for first, (ps, gs, bufs) in calls.items():
        compat.fused_sgd_(
            ps,
            gs,
            bufs,
            weight_decay=float(values["weight_decay"]),
            momentum=momentum,
            lr=float(values["lr"]),
            dampening=float(values["dampening"]),
            nesterov=bool(values["nesterov"]),
            maximize=bool(values["maximize"]),
            is_first_step=first,
        )


def sgd_values(
    h: dict[str, Any], step: Tensor, *, momentum: bool, fresh: bool = False
) -> dict[str, Any]:
    """The numbers SGD derives from its settings and the (N,) counts (numbers stay numbers;
    (N,) tensors in the counts' dtype), read by ``SGD.update_`` (a tensor ``lr`` negated).
    ``fresh``: the momentum buffer starts this step for every member (momentum was 0 until a
    scheduler changed it), as torch starts it, a copy of the gradient."""
    v: dict[str, Any] = {k: h[k] for k in ("lr", "weight_decay", "maximize", "nesterov")}
    if isinstance(h["maximize"], Tensor):
        v["sign"] = torch.where(h["maximize"], -1.0, 1.0)
    if isinstance(h["lr"], Tensor):
        v["lr"] = -h["lr"]
    if momentum:
        factor, keep = h["momentum"], h["dampening"]
        step = step.to(math_dtype(step.device))  # float32 counts (mode "fast") computed in float64
        if not isinstance(factor, Tensor):  # a fill, not a blocking host->device copy
            factor = torch.full((), factor, dtype=step.dtype, device=step.device)
        keep = 1 - (keep.to(step.dtype) if isinstance(keep, Tensor) else keep)
        factor = factor.to(step.dtype)
        fresh_members = (step == 1) | (factor == 0) | fresh
        v["momentum"] = factor.expand_as(step)
        v["decay"] = torch.where(fresh_members, 0.0, factor)
        v["weight"] = torch.where(fresh_members, 1.0, keep)
    return v
