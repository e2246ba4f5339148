"""accelerate with stacks: per-member clipping, loss scaling and checkpoints (``phalanx[hf]``).

``PhalanxAccelerator`` is an ``accelerate.Accelerator`` whose ``clip_grad_norm_`` clips each
member of a stack with its own norm (``phalanx.clip_grad_norm_``; accelerate's clips all
members with one), whose ``backward`` takes the (N,) per-member losses, whose float16 loss
scaling is a ``phalanx.MemberGradScaler`` (one scale per member; torch's skips every member
when one overflows), whose optimizer steps take a per-member mask, and whose
``save_state`` / ``load_state`` keep a stack of tied-weight models (safetensors refuses
their shared tensors) and ``save_model`` writes one ``save_pretrained`` folder per member.
What it cannot keep apart (DeepSpeed, FSDP, Megatron-LM, XLA) it refuses at ``prepare``.

The loop is the user's: ``accelerator.backward(losses)``, ``clip_grad_norm_`` and
``optimizer.step()`` run the eager step. ``accelerator.train_step(model, loss_fn,
optimizer)`` is the whole step as one call instead, captured by ``phalanx.compile_step``
where its own timing keeps it (``step="auto"``) and where accelerate's settings leave the step
to phalanx (one process, no float16 scaler, no gradient accumulation); elsewhere it runs the
eager step through the accelerator and says why.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import Tensor, nn

from phalanx.checkpoint._single import load, save
from phalanx.core._stack import Stack, live_stacks
from phalanx.optim import MemberOptimizer
from phalanx.population import TrainStep
from phalanx.population._step import StepMode, _target_dims, check_step, logger
from phalanx.train._clip import clip_grad_norm_
from phalanx.train._losses import member_losses
from phalanx.train._scaler import MemberGradScaler

from ._stacks import STACK_FILE, num_members, save_members, stacked_parameter_ids, stacks_in

__all__ = ["AcceleratedStep", "PhalanxAccelerator"]

_WHERE = "phalanx.integrations.accelerate.PhalanxAccelerator"
_COUPLING = {
    DistributedType.DEEPSPEED: "DeepSpeed (its engine clips, scales and steps all parameters as one)",
    DistributedType.FSDP: "FSDP (it flattens and shards parameters across members)",
    DistributedType.MEGATRON_LM: "Megatron-LM",
    DistributedType.XLA: "XLA",
}


class PhalanxAccelerator(accelerate.Accelerator):
    """An ``accelerate.Accelerator`` that keeps the members of phalanx stacks independent.

    Use it where ``Accelerator`` goes; models holding a ``phalanx.Stack`` (the stack itself or
    a module with one inside) are handled per member, everything else as accelerate does.

    - ``clip_grad_norm_(params, max_norm)``: with a stack's parameters, each member is
      clipped with its own norm and the (N,) norms are returned (accelerate's
      ``clip_grad_norm_`` clips every member by one joint norm).
    - ``backward(losses)``: the (N,) per-member losses; their sum is backpropagated, each
      member's loss scaled by its own scale under ``mixed_precision="fp16"``.
    - ``mixed_precision="fp16"``: the scaler is a ``phalanx.MemberGradScaler`` built with
      accelerate's settings (``GradScalerKwargs``); a member whose gradients overflow skips
      its own step and halves its own scale. It needs a phalanx optimizer.
    - ``member_mask``: (N,) bool or None, the members the prepared optimizers update (e.g.
      after early stopping); the others keep their weights and optimizer state.
    - ``save_state`` / ``load_state`` write and read each stack-holding model with
      ``phalanx.save`` / ``phalanx.load`` (tied weights kept); ``save_model`` writes one
      ``save_pretrained`` folder per member, ``member_0/``, ....

    Raises:
        ValueError: at ``prepare``, a model with a stack under DeepSpeed, FSDP, Megatron-LM or
            XLA, or float16 with an optimizer that is not a phalanx optimizer.

    Example:
        >>> from phalanx.integrations.accelerate import PhalanxAccelerator
        >>> accelerator = PhalanxAccelerator(cpu=True)
        >>> stack = phalanx.stack(lambda: nn.Linear(4, 2), num_members=3, seed=0)
        >>> opt = phalanx.optim.SGD(stack.parameters(), lr=0.1)
        >>> stack, opt = accelerator.prepare(stack, opt)
        >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        >>> accelerator.backward(phalanx.member_losses(F.cross_entropy, stack(x), y))
        >>> accelerator.clip_grad_norm_(stack.parameters(), 1.0).shape  # one norm per member
        torch.Size([3])
        >>> opt.step()
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stacks: list[Stack] = []
        self._stacked: set[int] = set()
        self._n: int | None = None
        self.member_mask: Tensor | None = None
        # set by a step that already updated the members (PhalanxTrainer's captured step):
        # the prepared optimizer's next step is then that one, not a second
        self._step_taken = False
        # a callable giving the mask at each step (the Trainer's early stopping), or None
        self.member_mask_fn: Callable[[], Tensor | None] | None = None
        self._torch_scaler: Any = getattr(
            self, "scaler", None
        )  # replaced by a MemberGradScaler once N is known
        self.register_save_state_pre_hook(self._save_stacks)
        self.register_load_state_pre_hook(self._load_stacks)

    # ------------------------------------------------------------------------- set-up

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """``Accelerator.prepare``, after finding the stacks and refusing what would couple
        their members (see the class)."""
        for obj in args:
            if isinstance(obj, nn.Module) and stacks_in(obj):
                self._add_stacks(obj)
        if self._stacks:
            for obj in args:
                if isinstance(obj, torch.optim.Optimizer):
                    self._check_optimizer(obj)
        return super().prepare(*args, device_placement=device_placement)

    def _add_stacks(self, model: nn.Module) -> None:
        why = _COUPLING.get(self.distributed_type)
        if why is not None:
            raise ValueError(
                f"{_WHERE}.prepare(): the model holds a phalanx stack and accelerate runs "
                f"{why}, which would train its members as one model. Use accelerate without it "
                f"(DDP keeps members apart: it averages each gradient element over processes), "
                f"or phalanx.distributed to spread members over processes."
            )
        stacks = [s for s in stacks_in(model) if s not in self._stacks]
        self._stacks += stacks
        self._n = num_members(self._stacks, f"{_WHERE}.prepare()")
        self._stacked = stacked_parameter_ids(self._stacks)
        current: Any = getattr(self, "scaler", None)
        if self._torch_scaler is not None and not isinstance(current, MemberGradScaler):
            torch_scaler = self._torch_scaler
            self.scaler = MemberGradScaler(
                self._n,
                device=self.device,
                init_scale=torch_scaler.get_scale(),
                growth_factor=torch_scaler.get_growth_factor(),
                backoff_factor=torch_scaler.get_backoff_factor(),
                growth_interval=torch_scaler.get_growth_interval(),
                enabled=torch_scaler.is_enabled(),
            )

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
        if isinstance(self.scaler, MemberGradScaler) and not isinstance(inner, MemberOptimizer):
            raise ValueError(
                f"{_WHERE}.prepare(): mixed_precision='fp16' scales each member's loss with its "
                f"own scale and skips only the members that overflow, which needs a phalanx "
                f"optimizer (its step takes a per-member mask); got {type(inner).__name__}. Use "
                f"phalanx.optim.{type(inner).__name__ if type(inner).__name__ in ('SGD', 'Adam', 'AdamW') else 'AdamW'}"
                f"(stack.parameters(), ...)."
            )

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: Any = None
    ) -> Any:
        """Wraps a phalanx optimizer so that its steps take ``member_mask`` and the
        per-member scaler; any other optimizer as accelerate does."""
        if not isinstance(optimizer, MemberOptimizer) or not self._stacks:
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if device_placement is None:
            device_placement = self.device_placement
        wrapped = _MemberOptimizer(optimizer, self, device_placement=device_placement)
        self._optimizers.append(wrapped)
        return wrapped

    def current_member_mask(self) -> Tensor | None:
        """The members to update this step: ``member_mask`` and ``member_mask_fn()``."""
        masks = [self.member_mask, self.member_mask_fn() if self.member_mask_fn else None]
        present = [m for m in masks if m is not None]
        if not present:
            return None
        out = present[0]
        for m in present[1:]:
            out = out & m
        return out

    # ---------------------------------------------------------------------- training

    def why_eager(self) -> str | None:
        """Why accelerate's settings need the eager step (through ``backward``, the scaler
        and the prepared optimizer), or None where the captured step can run."""
        if self.num_processes > 1:
            return f"{self.num_processes} processes: DDP averages the gradients in backward"
        if isinstance(self.scaler, MemberGradScaler) and self.scaler.is_enabled():
            return "mixed_precision='fp16' scales each member's loss in backward"
        if self.gradient_accumulation_steps != 1:
            return (
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} sums gradients "
                "over several batches before one optimizer step"
            )
        return None

    def train_step(
        self,
        model: nn.Module,
        loss_fn: Callable[..., Tensor] | None,
        optimizer: torch.optim.Optimizer,
        *,
        step: StepMode = "auto",
        max_norm: float | Tensor | None = None,
        norm_type: float = 2.0,
        in_dims: Any = None,
        target_in_dims: Any = "same",
        kw_in_dims: Any = None,
        backend: str = "inductor",
    ) -> AcceleratedStep:
        """The whole training step of a prepared stack as one call, captured where faster.

        ``losses = step(x, y)`` zeroes the gradients, runs the forward, ``member_losses``,
        backward, per-member clipping at ``max_norm`` and the optimizer step with
        ``member_mask``: captured by ``phalanx.compile_step`` with ``step="auto"`` (where its
        own timing keeps it) or ``"captured"``, where :meth:`why_eager` allows; else (and with
        ``step="eager"``) the eager step through this accelerator (``backward`` with its
        scaler, ``clip_grad_norm_``, the prepared optimizer). ``step.choice`` says which, and
        the ``phalanx`` logger says it.

        Args:
            model: the prepared stack (or the model ``prepare`` returned for it).
            loss_fn, in_dims, target_in_dims, kw_in_dims, max_norm, norm_type, backend: as
                for :func:`phalanx.compile_step`.
            optimizer: the prepared phalanx optimizer.
            step: "auto", "captured" or "eager".

        Raises:
            ValueError: ``step="captured"`` where :meth:`why_eager` gives a reason.
            TypeError: the model holds no stack, or the optimizer is not a phalanx one.
        """
        where = f"{_WHERE}.train_step()"
        check_step(step, where)
        stack = self.unwrap_model(model)
        if not isinstance(stack, Stack):
            raise TypeError(
                f"{where}: model must be a prepared phalanx stack; got {type(stack).__name__} "
                "(a module around a stack: call the step's parts yourself)."
            )
        inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
        if not isinstance(inner, MemberOptimizer):
            raise TypeError(
                f"{where}: optimizer must be a phalanx optimizer; got {type(inner).__name__}."
            )
        why = self.why_eager()
        if step == "captured" and why is not None:
            raise ValueError(
                f"{where}: step='captured' cannot run here: {why}. Use step='auto' (the eager "
                f"step through the accelerator where capture is not possible) or 'eager'."
            )
        options = {"in_dims": in_dims, "target_in_dims": target_in_dims,
                   "kw_in_dims": kw_in_dims, "max_norm": max_norm, "norm_type": norm_type}  # fmt: skip
        return AcceleratedStep(self, model, stack, loss_fn, optimizer, inner, step, why, options,
                               backend)  # fmt: skip

    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """Backpropagates the (N,) per-member losses (their sum, each member's scaled by its
        own scale under float16); a scalar loss as accelerate does, except under float16
        with a stack, where one summed loss cannot be scaled per member (refused)."""
        n = self._n
        if n is not None and loss.dim() == 1 and loss.shape[0] == n:
            loss = loss / self.gradient_accumulation_steps
            if isinstance(self.scaler, MemberGradScaler):
                self.scaler.scale(loss).backward(**kwargs)
            else:
                loss.sum().backward(**kwargs)
            return
        if isinstance(self.scaler, MemberGradScaler):
            raise ValueError(
                f"{_WHERE}.backward(): mixed_precision='fp16' scales each member's loss with its "
                f"own scale, so backward needs the per-member losses, shape ({n},); got shape "
                f"{tuple(loss.shape)}. Pass phalanx.member_losses(...) (or out.loss of a stack of "
                f"Hugging Face models) before summing."
            )
        super().backward(loss, **kwargs)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscales each member's gradients by its own scale (float16), else as accelerate."""
        if not isinstance(self.scaler, MemberGradScaler):
            return super().unscale_gradients(optimizer)
        optimizers = self._optimizers if optimizer is None else optimizer
        if not isinstance(optimizers, list | tuple):
            optimizers = [optimizers]
        for opt in optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            if not self.scaler._state(opt)["unscaled"]:
                self.scaler.unscale_(opt)

    def clip_grad_norm_(
        self, parameters: Iterable[Tensor] | Tensor, max_norm: float, norm_type: float = 2
    ) -> Tensor:
        """Clips each member of a stack with its own norm, returning the (N,) norms; other
        parameters as accelerate does.

        Raises:
            ValueError: the parameters mix a stack's with others (one joint norm would couple
                the members with them), or belong to a stack not passed to ``prepare``.
        """
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        mine = [id(p) in self._stacked for p in params]
        if not any(mine):
            ids = {id(p) for p in params}
            if any(id(p) in ids for s in live_stacks() for p in s.parameters()):
                raise ValueError(
                    f"{_WHERE}.clip_grad_norm_(): the parameters belong to a phalanx stack that "
                    f"was not passed to accelerator.prepare(), so accelerate would clip all its "
                    f"members by one joint norm. Prepare the model that holds the stack "
                    f"(accelerator.prepare(stack, optimizer)): then each member is clipped with "
                    f"its own norm (and, in float16, scaled with its own scale)."
                )
            return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        if not all(mine):
            others = sum(1 for m in mine if not m)
            raise ValueError(
                f"{_WHERE}.clip_grad_norm_(): the parameters mix a phalanx stack's with "
                f"{others} others; one norm over both would couple the members. Clip them "
                f"apart: accelerator.clip_grad_norm_(stack.parameters(), max_norm) clips each "
                f"member with its own norm, then clip the others on their own."
            )
        self.unscale_gradients()
        return clip_grad_norm_(params, max_norm, norm_type)

    # -------------------------------------------------------------------- checkpoints

    def _save_stacks(self, models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
        for i in reversed(range(len(models))):
            if stacks_in(models[i]):
                save(os.path.join(output_dir, f"{i}_{STACK_FILE}"), self.unwrap_model(models[i]))
                weights.pop(i)

    def _load_stacks(self, models: list[nn.Module], input_dir: str) -> None:
        for i in reversed(range(len(models))):
            if stacks_in(models[i]):
                load(os.path.join(input_dir, f"{i}_{STACK_FILE}"), self.unwrap_model(models[i]))
                models.pop(i)

    def save_model(
        self, model: nn.Module, save_directory: str | os.PathLike[str], **kwargs: Any
    ) -> None:
        """One ``save_pretrained`` folder per member, ``member_0/``, ..., for a model holding a
        stack (``from_pretrained`` reads each back); any other model as accelerate does."""
        unwrapped = self.unwrap_model(model)
        if not stacks_in(unwrapped):
            return super().save_model(model, save_directory, **kwargs)
        if self.is_main_process:
            save_members(unwrapped, save_directory)
        return None


class AcceleratedStep:
    """The step :meth:`PhalanxAccelerator.train_step` returns: ``losses = step(x, y)``.

    Attributes:
        mode: "auto", "captured" or "eager", as asked.
        choice: "captured" or "eager" once decided (None while "auto" is timing).
        last_norms: (N,) the members' norms before clipping, with ``max_norm``.
    """

    def __init__(
        self,
        accelerator: PhalanxAccelerator,
        model: nn.Module,
        stack: Stack,
        loss_fn: Callable[..., Tensor] | None,
        optimizer: Any,
        inner: MemberOptimizer,
        mode: StepMode,
        why: str | None,
        options: dict[str, Any],
        backend: str,
    ) -> None:
        self.accelerator, self.model, self.loss_fn, self.optimizer = (
            accelerator,
            model,
            loss_fn,
            optimizer,
        )
        self.mode, self.why, self.options = mode, why, options
        self.last_norms: Tensor | None = None
        self._captured: TrainStep | None = None
        self.choice: str | None = None
        self._target_dims = _target_dims(options["in_dims"], options["target_in_dims"], _WHERE)
        if mode != "eager" and why is None:
            self._captured = TrainStep(stack, loss_fn, inner, step=mode, backend=backend,
                                       where=f"{_WHERE}.train_step()", **options)  # fmt: skip
        else:
            self.choice = "eager"
            logger.info(
                "%s.train_step(): runs the eager step through the accelerator (%s)",
                _WHERE, why or "step='eager'",
            )  # fmt: skip

    @property
    def report(self) -> str:
        """Which step runs, and why (the captured step's timings)."""
        if self._captured is not None:
            return self._captured.report
        return f"the eager step through the accelerator ({self.why or 'step=' + repr(self.mode)})"

    def __call__(
        self,
        inputs: Tensor | tuple[Any, ...],
        target: Any = None,
        *,
        mask: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """One step of every member (``mask``: also leave these out, with ``member_mask``);
        returns the (N,) losses before the update, detached."""
        acc = self.accelerator
        masks = [m for m in (acc.current_member_mask(), mask) if m is not None]
        both = None
        for m in masks:
            both = m if both is None else both & m.to(both.device)
        if self._captured is not None:
            losses = self._captured(inputs, target, mask=both, **kwargs)
            self.last_norms, self.choice = self._captured.last_norms, self._captured.choice
            return losses
        opts = self.options
        self.optimizer.zero_grad()
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        out = self.model(*args, in_dims=opts["in_dims"], kw_in_dims=opts["kw_in_dims"], **kwargs)
        losses = member_losses(self.loss_fn, out, target, in_dims=(0, self._target_dims))
        acc.backward(losses)
        if opts["max_norm"] is not None:
            stack = acc.unwrap_model(self.model)
            self.last_norms = acc.clip_grad_norm_(
                stack.parameters(), opts["max_norm"], opts["norm_type"]
            )
        saved = acc.member_mask
        acc.member_mask = both if mask is not None else saved
        try:
            self.optimizer.step()
        finally:
            acc.member_mask = saved
        return losses.detach()


class _MemberOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper whose step passes the accelerator's member mask and
    steps through the per-member scaler."""

    def __init__(
        self, optimizer: MemberOptimizer, accelerator: PhalanxAccelerator, **kwargs: Any
    ) -> None:
        # accelerate's float16 path patches step to tell a skipped step; ours knows per member
        super().__init__(optimizer, scaler=None, **kwargs)
        self._accelerator = accelerator

    def step(self, closure: Any = None) -> None:
        if not self.gradient_state.sync_gradients:
            return
        if self._accelerator._step_taken:
            self._accelerator._step_taken = False
            self._is_overflow = False
            return
        mask = self._accelerator.current_member_mask()
        scaler = self._accelerator.scaler
        if isinstance(scaler, MemberGradScaler):
            scaler.step(self.optimizer, closure, mask=mask)
            scaler.update()
            # what accelerate (and the Trainer's LR schedule) read: True when no member stepped
            self._is_overflow = bool(scaler.last_skipped.all())
        else:
            self.optimizer.step(closure, mask=mask)
            self._is_overflow = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
