"""The training step a driver runs: captured (``phalanx.compile_step``) or eager, by ``step=``.

A population driver (PBT, successive halving), an Optuna group or a Ray Tune batch trains a
stack whose members change under it: PBT copies members in place, halving and
``TrialGroup.keep_live`` replace the stack by a smaller one. ``TrainStep`` is one training
step of every member that follows the driver's current stack and optimizer:

- ``step="auto"`` (the default): ``compile_step``'s own choice, the captured step where its
  timing on the first calls keeps it, else the eager one;
- ``step="captured"``: the captured step without the timing (``prefer="captured"``);
- ``step="eager"``: the eager step (zero the gradients, forward, ``member_losses``,
  backward, clip, ``optimizer.step(mask=...)``), the reference the captured one equals to
  float rounding.

The choice is not silent: ``TrainStep.choice`` and ``report`` say which step runs, the
``phalanx`` logger says it once decided, and the drivers of ``phalanx.integrations`` show it
(a progress bar's postfix, a log line).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from phalanx.core._stack import Stack
from phalanx.optim import MemberOptimizer
from phalanx.step._api import CompiledStep, compile_step
from phalanx.train._clip import clip_grad_norm_
from phalanx.train._losses import member_losses

logger = logging.getLogger("phalanx")

__all__ = ["STEPS", "StepMode", "TrainStep", "check_step", "recording"]

StepMode = Literal["auto", "captured", "eager"]
STEPS = ("auto", "captured", "eager")

# The steps built inside a driver's ``recording()`` (an Optuna or Ray Tune search) report to
# it, and take its ``step=`` where they are built with ``step=None``.
_recorder: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    "phalanx_step_recorder", default=None
)


def check_step(step: Any, where: str) -> StepMode:
    """``step`` must be one of ``STEPS``; returns it."""
    if step not in STEPS:
        raise ValueError(
            f"{where}: step must be 'auto' (the captured step where compile_step measures it "
            f"faster, else the eager one), 'captured' or 'eager'; got {step!r}."
        )
    return step


class _Recorder:
    """What a driver's ``recording()`` collects: its default mode and the steps' choices."""

    def __init__(self, step: StepMode) -> None:
        self.step = step
        self.choices: list[str] = []

    def summary(self) -> str | None:
        """``captured`` / ``eager`` / ``captured 3, eager 1``; None before any choice."""
        if not self.choices:
            return None
        kinds = sorted(set(self.choices))
        if len(kinds) == 1:
            return kinds[0]
        return ", ".join(f"{k} {self.choices.count(k)}" for k in kinds)


@contextlib.contextmanager
def recording(step: StepMode) -> Iterator[_Recorder]:
    """Within it, ``TrainStep(step=None)`` runs ``step`` and every step's choice is recorded."""
    recorder = _Recorder(step)
    token = _recorder.set(recorder)
    try:
        yield recorder
    finally:
        _recorder.reset(token)


class TrainStep:
    """One training step of every member, captured or eager as ``step`` says.

    Build it with a driver's ``train_step(...)`` (``PBT.train_step``,
    ``SuccessiveHalving.train_step``, ``TrialGroup.train_step``) or directly; call it as
    ``compile_step``'s step: ``losses = step(inputs, target, mask=...)``.

    Args:
        stack: the stack, or a function returning the driver's current stack (a new step is
            built when it changes: successive halving's smaller stack).
        loss_fn, in_dims, target_in_dims, kw_in_dims, max_norm, norm_type, backend: as for
            :func:`phalanx.compile_step`.
        optimizer: the stack's phalanx optimizer (it follows the stack as drivers compact it).
        step: "auto", "captured" or "eager" (see the module); None takes the enclosing
            search's ``step=`` (``optimize(..., step=...)`` of the Optuna and Ray Tune
            integrations), else "auto".
        on_choice: called with "captured" or "eager" each time the choice is made.

    Attributes:
        mode: the ``step`` it runs by ("auto", "captured" or "eager").
        choice: "captured" or "eager" once decided, None while ``auto`` is still timing.
        last_norms: (N,) the members' gradient norms before clipping, with ``max_norm``.
    """

    def __init__(
        self,
        stack: Stack | Callable[[], Stack],
        loss_fn: Callable[..., Tensor] | None,
        optimizer: MemberOptimizer,
        *,
        step: StepMode | None = None,
        in_dims: int | Sequence[int | None] | None = None,
        target_in_dims: int | Literal["same"] | None = "same",
        kw_in_dims: Any = None,
        max_norm: float | Tensor | None = None,
        norm_type: float = 2.0,
        backend: str | Callable[..., Any] = "inductor",
        on_choice: Callable[[str], None] | None = None,
        where: str = "phalanx.population.TrainStep()",
    ) -> None:
        recorder = _recorder.get()
        if step is None:
            step = recorder.step if recorder is not None else "auto"
        self.mode: StepMode = check_step(step, where)
        if not isinstance(optimizer, MemberOptimizer):
            raise TypeError(
                f"{where}: the step needs the stack's phalanx optimizer (phalanx.optim.Adam, "
                f"AdamW, SGD, Lion); got {type(optimizer).__name__}."
            )
        self._stack_of = stack if callable(stack) and not isinstance(stack, Stack) else None
        self._fixed = stack if isinstance(stack, Stack) else None
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self._kwargs: dict[str, Any] = {
            "in_dims": in_dims,
            "target_in_dims": target_in_dims,
            "kw_in_dims": kw_in_dims,
            "max_norm": max_norm,
            "norm_type": norm_type,
            "backend": backend,
        }
        self._where = where
        self._on_choice = [f for f in (on_choice, recorder.choices.append if recorder else None)
                           if f is not None]  # fmt: skip
        self._compiled: CompiledStep | None = None
        self._built_for: Stack | None = None
        self.choice: str | None = "eager" if self.mode == "eager" else None
        self.last_norms: Tensor | None = None
        self._announced: str | None = None
        if self.mode == "eager":
            self._target_dims = _target_dims(in_dims, target_in_dims, where)
        else:
            self._step()  # builds compile_step now: its argument errors are raised here

    @property
    def stack(self) -> Stack:
        """The stack the next call trains."""
        stack = self._fixed if self._stack_of is None else self._stack_of()
        assert stack is not None
        return stack

    @property
    def report(self) -> str:
        """One line: which step runs, and (captured or auto) compile_step's timings."""
        if self.mode == "eager":
            return "the eager step (step='eager')"
        if self._compiled is None:
            return "no step run yet"
        which = f"the {self.choice} step" if self.choice else "deciding"
        return f"{which} (step={self.mode!r}; {self._compiled.report})"

    def _step(self) -> CompiledStep:
        stack = self.stack
        if self._compiled is None or self._built_for is not stack:
            prefer: Literal["fastest", "captured"] = (
                "captured" if self.mode == "captured" else "fastest"
            )
            self._compiled = compile_step(stack, self.loss_fn, self.optimizer, prefer=prefer,
                                          **self._kwargs)  # fmt: skip
            self._built_for = stack
        return self._compiled

    def __call__(
        self,
        inputs: Tensor | tuple[Any, ...],
        target: Any = None,
        *,
        mask: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """One step of every member; returns their (N,) losses before the update, detached."""
        if self.mode == "eager":
            losses = self._eager(inputs, target, mask, kwargs)
        else:
            compiled = self._step()
            losses = compiled(inputs, target, mask=mask, **kwargs)
            self.last_norms = compiled.last_norms
            self.choice = compiled.choice
        if self.choice is not None and self.choice != self._announced:
            self._announced = self.choice
            logger.info("%s: runs %s", self._where, self.report)
            for f in self._on_choice:
                f(self.choice)
        return losses

    def _eager(self, inputs: Any, target: Any, mask: Tensor | None, kwargs: dict) -> Tensor:
        """The step as a user writes it: the reference of the captured one."""
        opt = self.optimizer
        opt.zero_grad(set_to_none=True)
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        k = self._kwargs
        out = self.stack(*args, in_dims=k["in_dims"], kw_in_dims=k["kw_in_dims"], **kwargs)
        losses = member_losses(self.loss_fn, out, target, in_dims=(0, self._target_dims))
        losses.sum().backward()
        losses = losses.detach()
        if k["max_norm"] is not None:
            self.last_norms = clip_grad_norm_(
                self.stack.parameters(), k["max_norm"], k["norm_type"]
            )
        if mask is not None:
            mask = torch.as_tensor(mask, device=losses.device)
        opt.step(mask=mask, loss=losses)
        return losses


def _target_dims(in_dims: Any, target_in_dims: Any, where: str) -> int | None:
    """``target_in_dims`` resolved as ``compile_step`` resolves it."""
    if target_in_dims == "same":
        if in_dims is not None and not isinstance(in_dims, int):
            raise ValueError(
                f"{where}: with several inputs (in_dims={in_dims!r}) say how the target maps "
                f"over the members: target_in_dims=None (shared) or 0 (per-member)."
            )
        target_in_dims = in_dims
    if target_in_dims not in (None, 0):
        raise ValueError(
            f"{where}: target_in_dims must be None (shared) or 0 (per-member); got "
            f"{target_in_dims!r}."
        )
    return target_in_dims
