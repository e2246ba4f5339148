"""Successive halving (ASHA-style early stopping) inside one stack.

At each milestone the members are ranked by a metric and only the best 1/``reduction_factor``
go on; the others are dropped from the stack, optimizer and loader, so the steps after a
milestone cost what the smaller stack costs. ASHA (Li et al. 2020) promotes trials
asynchronously as each reaches a rung; in a stack every member reaches a rung at the same
step, so ASHA's rule (keep the top 1/eta of those at the rung) is exactly this synchronous
one, with the rungs ASHA uses: grace_period * eta**k.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from phalanx.checkpoint._single import CheckpointError, read, restore, save
from phalanx.data import MemberLoader
from phalanx.optim import MemberOptimizer
from phalanx.population._pbt import check_mode, ranking
from phalanx.population._rows import check_run
from phalanx.population._step import StepMode, TrainStep
from phalanx.population._surgery import keep_members

if TYPE_CHECKING:
    from phalanx.core._stack import Stack

__all__ = ["Rungs", "SuccessiveHalving", "rungs"]


class Rungs(list[int]):
    """Milestones that remember the reduction factor they were made with (see ``rungs``)."""

    reduction_factor: float


def rungs(grace_period: int, reduction_factor: float, max_steps: int) -> Rungs:
    """ASHA's milestones: grace_period * reduction_factor**k below max_steps.

    The list carries ``reduction_factor``, which ``SuccessiveHalving`` then uses: one setting for
    one thing.

    Example:
        >>> rungs(10, 2, 100)
        [10, 20, 40, 80]
    """
    if reduction_factor <= 1:
        raise ValueError(
            f"phalanx.population.rungs(): reduction_factor must be > 1; got {reduction_factor!r}."
        )
    out, step = Rungs(), float(grace_period)
    while step < max_steps:
        out.append(int(step))
        step *= reduction_factor
    out.reduction_factor = reduction_factor
    return out


class SuccessiveHalving:
    """Stops the worse members of a stack at milestones, keeping the best 1/eta each time.

    Args:
        stack: the stack, N members.
        optimizer: its phalanx optimizer, compacted in place with the stack.
        milestones: the steps at which to stop members, e.g. ``rungs(grace, eta, max_steps)``.
        loader: its MemberLoader, compacted in place with the stack.
        reduction_factor: eta: keep ceil(n / eta) of the n members at each milestone. By
            default the one ``rungs(...)`` made the milestones with, else 2.
        min_members: never keep fewer.
        mode: "max" if a larger metric is better, "min" for a loss; required.

    Attributes:
        stack: the current stack; a new, smaller one after each ``stop``.
        members: the original index of each member of ``stack``.
        log: one dict per milestone: step, members kept and stopped (original indices), and
            every member's metric there.

    Example:
        >>> X, Y = torch.randn(64, 4), torch.randn(64, 1)
        >>> stack = phalanx.stack(lambda: nn.Linear(4, 1), num_members=8)
        >>> opt = phalanx.optim.SGD(stack.parameters(), lr=torch.logspace(-3, 0, 8))
        >>> halving = phalanx.population.SuccessiveHalving(
        ...     stack, opt, phalanx.population.rungs(10, 2, 50), mode="min")
        >>> for step in range(1, 51):
        ...     opt.zero_grad()  # the optimizer follows halving.stack as it shrinks
        ...     phalanx.member_losses(F.mse_loss, halving.stack(X), Y).sum().backward()
        ...     opt.step()
        ...     if halving.ready(step):  # steps 10, 20 and 40: keep 4, then 2, then 1
        ...         losses = phalanx.metrics.loss(F.mse_loss, halving.stack(X), Y)
        ...         _ = halving.stop(losses, step=step)
        >>> [len(entry["kept"]) for entry in halving.log], halving.members
        ([4, 2, 1], [5])
    """

    def __init__(
        self,
        stack: Stack,
        optimizer: MemberOptimizer | None,
        milestones: Sequence[int],
        *,
        loader: MemberLoader | None = None,
        reduction_factor: float | None = None,
        min_members: int = 1,
        mode: str | None = None,
    ) -> None:
        where = "phalanx.population.SuccessiveHalving()"
        check_run(stack, optimizer, loader, where)
        made_with = getattr(milestones, "reduction_factor", None)
        if reduction_factor is None:
            reduction_factor = 2 if made_with is None else made_with
        elif made_with is not None and made_with != reduction_factor:
            raise ValueError(
                f"{where}: the milestones were made by rungs() with reduction_factor="
                f"{made_with}, but reduction_factor={reduction_factor} was given; leave "
                "reduction_factor out (it is taken from the rungs) or make both the same."
            )
        if reduction_factor <= 1:
            raise ValueError(f"{where}: reduction_factor must be > 1; got {reduction_factor!r}.")
        if isinstance(min_members, bool) or not isinstance(min_members, int) or min_members < 1:
            raise ValueError(f"{where}: min_members must be a positive int; got {min_members!r}.")
        check_mode(mode, where)
        if list(milestones) != sorted(set(milestones)) or any(m < 1 for m in milestones):
            raise ValueError(
                f"{where}: milestones must be increasing positive steps; got {list(milestones)}."
            )
        self.stack = stack
        self.optimizer = optimizer
        self.loader = loader
        self.milestones = list(milestones)
        self.reduction_factor = reduction_factor
        self.min_members = min_members
        self.mode = mode
        self.members = list(range(len(stack)))
        self.log: list[dict[str, Any]] = []
        self.last_step = 0

    def train_step(
        self, loss_fn: Callable[..., Tensor] | None, *, step: StepMode = "auto", **kwargs: Any
    ) -> TrainStep:
        """The training step of ``self.stack``, following it as it shrinks.

        Each milestone's smaller stack gets its own step (captured again, timed again with
        "auto"), since its shapes are new.

        Args:
            loss_fn: as for :func:`phalanx.compile_step`.
            step: "auto" (the captured step where its timing keeps it), "captured" or
                "eager"; ``.choice`` says which runs, and the ``phalanx`` logger says it.
            **kwargs: ``compile_step``'s ``in_dims``, ``target_in_dims``, ``kw_in_dims``,
                ``max_norm``, ``norm_type``, ``backend``.

        Raises:
            TypeError: the driver was built without the stack's optimizer.
        """
        where = "phalanx.population.SuccessiveHalving.train_step()"
        if self.optimizer is None:
            raise TypeError(f"{where}: build the driver with the stack's phalanx optimizer.")
        return TrainStep(lambda: self.stack, loss_fn, self.optimizer, step=step, where=where,
                         **kwargs)  # fmt: skip

    def ready(self, step: int) -> bool:
        """True when ``step`` is a milestone not handled yet."""
        return step > self.last_step and step in self.milestones

    @torch.no_grad()
    def stop(self, metric: Tensor, *, step: int) -> Stack:
        """Keeps the best ceil(n / eta) members (at least ``min_members``) and drops the rest.

        Args:
            metric: (n,) one value per current member; NaN ranks last.
            step: the training step, for the log.

        Returns:
            The new, smaller stack (also ``self.stack``); the optimizer and loader now follow it.
        """
        where = "phalanx.population.SuccessiveHalving.stop()"
        metric = torch.as_tensor(metric).detach().double().cpu()
        n = len(self.stack)
        if metric.shape != (n,):
            raise ValueError(
                f"{where}: metric must hold one value per current member, shape ({n},); got "
                f"{tuple(metric.shape)}."
            )
        k = min(n, max(self.min_members, math.ceil(n / self.reduction_factor)))
        keep = sorted(ranking(metric, str(self.mode))[:k].tolist())  # kept in their old order
        stopped = sorted(set(range(n)) - set(keep))
        if stopped:  # first, so that a refusal marks nothing done
            self.stack = keep_members(
                self.stack, keep, optimizer=self.optimizer, loader=self.loader
            )
        self.log.append(
            {
                "step": step,
                "kept": [self.members[i] for i in keep],
                "stopped": [self.members[i] for i in stopped],
                "metric": dict(zip(map(str, self.members), metric.tolist())),
            }
        )
        self.last_step = step
        self.members = [self.members[i] for i in keep]
        return self.stack

    # ------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The surviving members, the log and the last milestone handled."""
        return {"members": self.members, "log": self.log, "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what ``state_dict`` saved; the stack must already hold those members."""
        self.members = [int(i) for i in state["members"]]
        self.log = list(state["log"])
        self.last_step = int(state["last_step"])

    def save(self, path: str, **extra: Any) -> None:
        """Saves the (compacted) stack, optimizer, loader and this driver with ``phalanx.save``."""
        save(
            path, self.stack, optimizer=self.optimizer, loader=self.loader,
            population=self.state_dict(), **extra,
        )  # fmt: skip

    def load(self, path: str) -> dict[str, Any]:
        """Resumes a run saved by ``save``, from a driver built over the full, fresh stack.

        The stack, optimizer and loader are first compacted to the saved survivors, then
        loaded; use ``self.stack`` afterwards.

        Returns:
            The other ``extra`` values given to ``save``.
        """
        where = "phalanx.population.SuccessiveHalving.load()"
        meta, tensors = read(os.fspath(path), where)  # one reader, read once
        survivors = _saved_members(meta, path)
        if survivors != self.members:
            index = [self.members.index(i) for i in survivors]
            self.stack = keep_members(
                self.stack, index, optimizer=self.optimizer, loader=self.loader
            )
            self.members = survivors
        extra = restore(
            where, os.fspath(path), meta, tensors, self.stack, self.optimizer, loader=self.loader
        )
        self.load_state_dict(extra.pop("population"))
        return extra


def _saved_members(meta: dict[str, Any], path: str) -> list[int]:
    """The surviving members recorded in a checkpoint's metadata, read before the stack is
    compacted to them (``restore`` needs a stack of the saved size)."""
    try:
        return [int(i) for i in meta["extra"]["population"]["members"]]
    except (KeyError, TypeError) as e:
        raise CheckpointError(
            f"phalanx.population.SuccessiveHalving.load(): '{path}' holds no successive "
            "halving state; write it with SuccessiveHalving.save()."
        ) from e
