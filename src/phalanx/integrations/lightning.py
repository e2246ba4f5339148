"""PyTorch Lightning: a stack trained by ``pytorch_lightning.Trainer`` with its members apart.

Lightning sees one model and one loss. Left alone it couples the members in two places: its
``gradient_clip_val`` clips all parameters with one norm (``torch.nn.utils.clip_grad_norm_``),
so one member's exploding gradient shrinks every other member's step, and its callbacks
(``EarlyStopping``, ``ModelCheckpoint``) watch one scalar. This module plugs into Lightning's
own extension points instead:

- :class:`StackModule`, a ``LightningModule`` base class: ``clip_gradients`` (which the default
  ``configure_gradient_clipping`` calls with the Trainer's ``gradient_clip_val``) clips each
  member with its own norm (:func:`phalanx.clip_grad_norm_`); ``optimizer_step`` steps only
  the members still training (``mask=`` of the phalanx optimizer); :meth:`StackModule.log_members`
  logs an (N,) tensor as N scalars ``name/member_i``; ``setup`` refuses what Lightning cannot
  run with the members apart, naming the fix.
- ``StackModule(step="auto")`` (or "captured", "eager"): phalanx runs the whole training
  step, captured (``phalanx.compile_step``) where that measures faster: the module uses
  Lightning's manual optimization and ``training_step`` calls
  :meth:`StackModule.member_step`; the chosen step is said in Lightning's log and in
  :attr:`StackModule.step_choice`. Without ``step`` Lightning's automatic optimization runs
  the eager step (its closure, ``backward`` and ``optimizer_step`` are Lightning's).
- :class:`MemberEarlyStopping`: Lightning's early stopping, one patience counter per member; a
  member that stops is masked out of the optimizer step (its weights and optimizer state stay
  bit for bit); the Trainer stops when every member has.
- :class:`MemberCheckpoint`: each member's best weights in a file of its own
  (``member_03.safetensors``), loadable into one ordinary member module. Lightning's own
  ``ModelCheckpoint`` / ``Trainer.save_checkpoint`` keep the whole stack, and
  ``load_from_checkpoint`` reads it back with the members' masks.

Needs ``pip install phalanx[lightning]`` (the ``pytorch-lightning`` package).

Example:
    >>> import pytorch_lightning as pl
    >>> from phalanx.integrations.lightning import StackModule
    >>> class Ensemble(StackModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.stack = phalanx.stack(lambda: nn.Linear(4, 3), num_members=4, seed=0)
    ...     def training_step(self, batch, batch_idx):
    ...         x, y = batch
    ...         losses = phalanx.member_losses(F.cross_entropy, self.stack(x), y)  # (N,)
    ...         self.log_members("train_loss", losses)
    ...         return losses.sum()  # member i's gradient is its own loss's
    ...     def configure_optimizers(self):
    ...         return phalanx.optim.SGD(self.stack.parameters(), lr=[0.1, 0.2, 0.3, 0.4])
    >>> data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
    >>> trainer = pl.Trainer(max_epochs=1, gradient_clip_val=1.0, logger=False,
    ...                      enable_checkpointing=False, enable_progress_bar=False,
    ...                      enable_model_summary=False, accelerator="cpu")
    >>> trainer.fit(Ensemble(), torch.utils.data.DataLoader(data, batch_size=16))
    >>> sorted(trainer.logged_metrics)[:2]
    ['train_loss/member_0', 'train_loss/member_1']
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision
from pytorch_lightning.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from pytorch_lightning.utilities import rank_zero_info
from safetensors.torch import save_file
from torch import Tensor, nn

from phalanx.checkpoint._single import export_members
from phalanx.core._inplace import StackedModuleList
from phalanx.core._stack import Stack
from phalanx.distributed._shard import _shards
from phalanx.optim import MemberOptimizer
from phalanx.population import TrainStep
from phalanx.population._step import StepMode, check_step
from phalanx.train._clip import clip_grad_norm_, clip_grad_value_

__all__ = ["MemberCheckpoint", "MemberEarlyStopping", "StackModule", "check_trainer"]

_CKPT_KEY = "phalanx"


def _stacks(module: nn.Module) -> Iterator[tuple[str, Stack | StackedModuleList]]:
    """The stacks inside ``module`` (outermost only), with their attribute paths."""
    inner: list[str] = []
    for name, m in module.named_modules():
        if any(name.startswith(p + ".") for p in inner):
            continue
        if isinstance(m, Stack | StackedModuleList):
            inner.append(name)
            yield name, m


def _members_of(module: nn.Module, where: str) -> int:
    """N, the number of members of the stacks in ``module`` (all must agree)."""
    found = {name or "(the module)": len(s) for name, s in _stacks(module)}
    if not found:
        raise TypeError(
            f"{where}: {type(module).__name__} holds no phalanx stack. Build one with "
            f"phalanx.stack(...) (or phalanx.stack_in_place) and assign it as an attribute, "
            f"e.g. self.stack = phalanx.stack(make_model, num_members=8)."
        )
    if len(set(found.values())) > 1:
        raise ValueError(
            f"{where}: the stacks of {type(module).__name__} have different numbers of "
            f"members {found}; one Lightning module trains one set of N members: give every "
            f"stack the same num_members."
        )
    return next(iter(found.values()))


def check_trainer(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    """Refuses the Trainer settings under which Lightning would couple the members.

    Called by :class:`StackModule` and the callbacks of this module at set-up, before any step.

    Args:
        trainer: the Trainer about to fit ``module``.
        module: the LightningModule holding the stack(s).

    Raises:
        ValueError: a setting that cannot keep members apart, with the fix: a precision with
            a shared ``GradScaler`` (one member's overflow skips every member's step), a
            strategy that shards or flattens the stacked parameters (FSDP, DeepSpeed,
            model parallel), or DDP over ranks that hold different members.
        TypeError: Trainer gradient clipping on a module that is not a :class:`StackModule`
            (its clip would be one norm over all members).
    """
    where = "phalanx.integrations.lightning"
    _members_of(module, where)
    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy | FSDPStrategy | ModelParallelStrategy):
        raise ValueError(
            f"{where}: strategy {type(strategy).__name__} shards or flattens the parameters and "
            f"clips and steps them as one (the stacked member axis is lost, members are "
            f"coupled). Use strategy='ddp' (each rank holds all N members; gradients are "
            f"averaged per member) or phalanx.distributed.shard to put members on ranks."
        )
    precision = trainer.precision_plugin
    if isinstance(precision, MixedPrecision) and precision.scaler is not None:
        raise ValueError(
            f"{where}: Trainer(precision={trainer.precision!r}) uses one torch.amp.GradScaler for "
            f"all members: one member's overflow skips every member's step and halves the "
            f"shared scale. Use precision='bf16-mixed' (no scaler) or '32-true'."
        )
    if trainer.world_size > 1:
        for name, s in _stacks(module):
            shard = _shards.get(s) if isinstance(s, Stack) else None
            if shard is not None and shard.world_size > shard.num_replicas:
                raise ValueError(
                    f"{where}: stack {name!r} holds members {shard.start}.."
                    f"{shard.start + shard.num_local - 1} of "
                    f"{shard.num_members} on rank {shard.rank}, but the Trainer's "
                    f"{type(strategy).__name__} averages gradients over all "
                    f"{trainer.world_size} ranks, mixing different members' gradients. Train "
                    f"member shards with phalanx.distributed (average over "
                    f"shard.replica_group only), or give every rank all N members."
                )
    clip = trainer.gradient_clip_val
    if clip is not None and clip > 0 and not isinstance(module, StackModule):
        raise TypeError(
            f"{where}: Trainer(gradient_clip_val={clip}) on {type(module).__name__}, which is "
            f"not a phalanx.integrations.lightning.StackModule: Lightning would clip all members "
            f"with one norm (torch.nn.utils.clip_grad_norm_). Derive the module from StackModule "
            f"(it clips each member with its own norm), or drop gradient_clip_val and call "
            f"phalanx.clip_grad_norm_ in configure_gradient_clipping."
        )


class StackModule(pl.LightningModule):
    """A ``LightningModule`` whose stacks keep their members apart in Lightning's loop.

    Subclass it as you would ``pl.LightningModule``: assign a stack (``self.stack =
    phalanx.stack(...)``), return ``losses.sum()`` from ``training_step`` (the sum's gradient
    for member i is member i's own loss's gradient, exactly) and a phalanx optimizer from
    ``configure_optimizers``. Then:

    - ``Trainer(gradient_clip_val=c)`` clips each member's gradient norm to ``c`` on its own
      (``gradient_clip_algorithm="value"`` clamps elementwise, which never mixes members);
      the (N,) norms before clipping are in :attr:`last_grad_norms`.
    - members set False in :attr:`member_mask` (by :class:`MemberEarlyStopping`, or by you)
      are left out of every optimizer step, weights and optimizer state unchanged bit for bit.
    - checkpoints carry the mask, so ``load_from_checkpoint`` resumes with the same members.

    With ``step="auto"`` (or "captured", "eager") phalanx runs the whole step instead: the
    module uses manual optimization and ``training_step`` calls ``losses =
    self.member_step(loss_fn, x, y)``, which zeroes the gradients, runs the forward,
    ``member_losses``, backward, clipping (``max_norm=``, in place of the Trainer's
    ``gradient_clip_val``, which Lightning refuses under manual optimization) and the masked
    optimizer step, captured by :func:`phalanx.compile_step` where its own timing keeps it
    ("auto"), always ("captured") or never ("eager"). Lightning counts the step
    (``global_step``) as its own.

    If you override ``setup``, ``optimizer_step``, ``clip_gradients``, ``on_save_checkpoint``
    or ``on_load_checkpoint``, call ``super()``'s.

    Args:
        step: None (the default: Lightning's automatic optimization, the eager step), or
            "auto", "captured", "eager": phalanx's step through :meth:`member_step`.

    Attributes:
        member_mask: (N,) bool, the members still training (all True until one stops).
        last_grad_norms: (N,) each member's gradient norm before the last clip, or None.
        step_choice: the step :meth:`member_step` runs, "captured" or "eager" (None before it
            decided, and without ``step``); said once in Lightning's log.
    """

    member_mask: Tensor | None
    last_grad_norms: Tensor | None

    def __init__(self, *args: Any, step: StepMode | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.member_mask = None
        self.last_grad_norms = None
        self.step_mode = None if step is None else check_step(step, f"{type(self).__name__}()")
        self.step_choice: str | None = None
        self._train_step: tuple[Any, TrainStep] | None = None
        if self.step_mode is not None:
            self.automatic_optimization = False

    @property
    def num_members(self) -> int:
        """N, the number of members of the module's stacks."""
        return _members_of(self, f"{type(self).__name__}.num_members")

    def _mask(self) -> Tensor:
        if self.member_mask is None:
            self.member_mask = torch.ones(self.num_members, dtype=torch.bool)
        return self.member_mask

    def setup(self, stage: str) -> None:
        """Refuses the Trainer settings that would couple members (see :func:`check_trainer`)."""
        check_trainer(self.trainer, self)
        self._mask()

    def member_step(
        self,
        loss_fn: Callable[..., Tensor] | None,
        inputs: Tensor | tuple[Any, ...],
        target: Any = None,
        **kwargs: Any,
    ) -> Tensor:
        """One training step of every member, in ``training_step`` of a module built with
        ``step=``; returns the (N,) losses before the update.

        Args:
            loss_fn: as for :func:`phalanx.compile_step` (``F.cross_entropy``).
            inputs, target: the batch, as for the step of :func:`phalanx.compile_step`.
            **kwargs: ``compile_step``'s ``in_dims``, ``target_in_dims``, ``kw_in_dims``,
                ``max_norm``, ``norm_type``, ``backend`` (fixed by the first call: a call
                with others builds a new step), and the members' keyword inputs.

        Raises:
            ValueError: the module was built without ``step=`` (Lightning runs the step).
            TypeError: configure_optimizers returned several optimizers or a torch optimizer.
        """
        name = f"{type(self).__name__}.member_step()"
        if self.step_mode is None:
            raise ValueError(
                f"{name}: the module was built without step=, so Lightning's automatic "
                f"optimization runs the step; build it with super().__init__(step='auto') "
                f"(phalanx runs the step, captured where that is faster), or return "
                f"losses.sum() from training_step."
            )
        options = {k: kwargs.pop(k) for k in _STEP_OPTIONS if k in kwargs}
        lopt: Any = self.optimizers()
        if isinstance(lopt, list):
            raise TypeError(
                f"{name}: configure_optimizers returned {len(lopt)} optimizers; the step "
                f"trains one stack with one phalanx optimizer."
            )
        key = (loss_fn, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if self._train_step is None or self._train_step[0] != key:
            stacks = [s for _, s in _stacks(self) if isinstance(s, Stack)]
            if len(stacks) != 1:
                raise TypeError(
                    f"{name}: the step trains one phalanx.stack(...); "
                    f"{type(self).__name__} holds {len(stacks)}."
                )
            inner = lopt.optimizer
            if not isinstance(inner, MemberOptimizer):
                raise TypeError(
                    f"{name}: configure_optimizers returned {type(inner).__name__}; return a "
                    f"phalanx optimizer (phalanx.optim.Adam, AdamW, SGD, Lion) over the stack."
                )
            step = TrainStep(stacks[0], loss_fn, inner, step=self.step_mode, where=name,
                             on_choice=self._chosen, **options)  # fmt: skip
            self._train_step = (key, step)
        live = self._mask()
        mask = None if bool(live.all()) else live
        # Lightning counts an optimizer step (global_step, its progress) around its
        # optimizer's step; the step runs the phalanx optimizer itself, so count it here.
        lopt._on_before_step()
        try:
            losses = self._train_step[1](inputs, target, mask=mask, **kwargs)
        finally:
            lopt._on_after_step()
        self.last_grad_norms = self._train_step[1].last_norms
        return losses

    def _chosen(self, choice: str) -> None:
        self.step_choice = choice
        assert self._train_step is not None
        rank_zero_info(f"phalanx: {type(self).__name__} trains with {self._train_step[1].report}")

    def log_members(self, name: str, values: Tensor, **kwargs: Any) -> None:
        """Logs an (N,) tensor as N scalars ``f"{name}/member_{i}"`` through ``self.log_dict``.

        Args:
            name: the metric's name, e.g. ``"val_loss"``.
            values: (N,) one value per member.
            **kwargs: passed to ``log_dict`` (``on_step``, ``on_epoch``, ``prog_bar``, ...).

        Raises:
            ValueError: ``values`` is not of shape (N,).
        """
        n = self.num_members
        if values.shape != (n,):
            raise ValueError(
                f"{type(self).__name__}.log_members({name!r}): expected one value per member, "
                f"shape ({n},); got shape {tuple(values.shape)}. Pass per-member values "
                f"(e.g. phalanx.member_losses(...)), not their sum."
            )
        values = values.detach()
        self.log_dict({f"{name}/member_{i}": values[i] for i in range(n)}, **kwargs)

    def clip_gradients(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clips each member's gradients on its own, as Lightning's clip would for it alone.

        Resolves the value and algorithm from the Trainer as Lightning does; "norm" runs
        :func:`phalanx.clip_grad_norm_` (one norm per member, (N,) kept in
        :attr:`last_grad_norms`), "value" :func:`phalanx.clip_grad_value_`, over the
        optimizer's parameters.
        """
        trainer_val = self.trainer.gradient_clip_val
        if gradient_clip_val is None:
            gradient_clip_val = trainer_val or 0.0
        elif trainer_val is not None and trainer_val != gradient_clip_val:
            raise ValueError(
                f"{type(self).__name__}.clip_gradients(): Trainer(gradient_clip_val="
                f"{trainer_val!r}) and clip_gradients(gradient_clip_val={gradient_clip_val!r}) "
                f"differ; set only one of them."
            )
        algorithm = gradient_clip_algorithm or self.trainer.gradient_clip_algorithm or "norm"
        algorithm = str(getattr(algorithm, "value", algorithm)).lower()
        if gradient_clip_val <= 0:
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return
        if algorithm == "norm":
            self.last_grad_norms = clip_grad_norm_(params, max_norm=gradient_clip_val)
        elif algorithm == "value":
            clip_grad_value_(params, gradient_clip_val)
        else:
            raise ValueError(
                f"{type(self).__name__}.clip_gradients(): gradient_clip_algorithm "
                f"{algorithm!r} is not 'norm' or 'value'."
            )

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Any,
        optimizer_closure: Any = None,
    ) -> None:
        """Steps the members of :attr:`member_mask` only (all of them while none has stopped)."""
        mask = self._mask()
        if bool(mask.all()):
            optimizer.step(closure=optimizer_closure)
            return
        inner = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps it
        if not isinstance(inner, MemberOptimizer):
            raise TypeError(
                f"{type(self).__name__}.optimizer_step(): members "
                f"{(~mask).nonzero().flatten().tolist()} have stopped, but "
                f"{type(inner).__name__} cannot leave members out of a step. Return a phalanx "
                f"optimizer (phalanx.optim.SGD / Adam / ...) from configure_optimizers."
            )
        optimizer.step(closure=optimizer_closure, mask=mask.to(inner.frozen.device))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Stores :attr:`member_mask` in the checkpoint."""
        checkpoint[_CKPT_KEY] = {"member_mask": self._mask().clone()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restores :attr:`member_mask` from the checkpoint."""
        saved = checkpoint.get(_CKPT_KEY)
        if saved is not None:
            self.member_mask = saved["member_mask"].clone()


_STEP_OPTIONS = ("in_dims", "target_in_dims", "kw_in_dims", "max_norm", "norm_type", "backend")


def _stack_module(pl_module: pl.LightningModule, where: str) -> StackModule:
    if not isinstance(pl_module, StackModule):
        raise TypeError(
            f"{where}: {type(pl_module).__name__} is not a "
            f"phalanx.integrations.lightning.StackModule; derive it from StackModule (instead "
            f"of pl.LightningModule) so that stopped members can be left out of its steps."
        )
    return pl_module


class _PerMember(pl.Callback):
    """Reads ``f"{monitor}/member_{i}"`` for every member from the Trainer's metrics."""

    def __init__(self, monitor: str, mode: str, min_delta: float) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"{type(self).__name__}: mode must be 'min' or 'max', got {mode!r}.")
        self.monitor = monitor
        self.mode = mode
        self.min_delta = abs(min_delta)
        self.best: Tensor | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, mode=self.mode)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_trainer(trainer, _stack_module(pl_module, type(self).__name__))

    def scores(self, trainer: pl.Trainer, n: int) -> Tensor:
        logs = trainer.callback_metrics
        keys = [f"{self.monitor}/member_{i}" for i in range(n)]
        missing = [k for k in keys if k not in logs]
        if missing:
            raise KeyError(
                f"{type(self).__name__}(monitor={self.monitor!r}): the metrics {missing[:3]}"
                f"{'...' if len(missing) > 3 else ''} were not logged; found "
                f"{sorted(logs)[:6]}. Log one value per member with "
                f"self.log_members({self.monitor!r}, values) in the LightningModule."
            )
        return torch.stack([logs[k].detach().float().cpu() for k in keys])

    def improved(self, scores: Tensor) -> Tensor:
        """(N,) bool: members whose score beats their best by more than ``min_delta``."""
        if self.best is None:
            self.best = torch.full_like(scores, math.inf if self.mode == "min" else -math.inf)
        if self.mode == "min":
            better = scores < self.best - self.min_delta
        else:
            better = scores > self.best + self.min_delta
        return better & scores.isfinite()

    @staticmethod
    def skip(trainer: pl.Trainer) -> bool:
        return (
            trainer.state.fn != "fit"
            or trainer.sanity_checking
            or bool(getattr(trainer, "fast_dev_run", False))
        )


class MemberEarlyStopping(_PerMember):
    """Lightning's early stopping, member by member: a member that stops is masked out.

    After each validation (or training epoch, with ``check_on_train_epoch_end``), member i's
    score is the logged metric ``f"{monitor}/member_{i}"`` (see
    :meth:`StackModule.log_members`). A member whose score has not improved by more than
    ``min_delta`` for ``patience`` checks in a row, or is not finite, stops: it is set False in
    the module's ``member_mask`` and every later optimizer step leaves its weights and
    optimizer state unchanged. The Trainer stops when every member has. Its state (best
    scores, counters, stop epochs) is saved in Lightning checkpoints.

    Args:
        monitor: the metric's name without the ``/member_i`` suffix, e.g. ``"val_loss"``.
        mode: "min" or "max".
        patience: checks without improvement before a member stops.
        min_delta: the smallest change that counts as an improvement.
        check_on_train_epoch_end: check after each training epoch instead of each validation.

    Attributes:
        stopped_epoch: (N,) the epoch at which each member stopped, -1 while it trains.
        wait_count: (N,) checks since each member last improved.
    """

    def __init__(
        self,
        monitor: str,
        *,
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        check_on_train_epoch_end: bool = False,
    ) -> None:
        super().__init__(monitor, mode, min_delta)
        self.patience = patience
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.wait_count: Tensor | None = None
        self.stopped_epoch: Tensor | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization and getattr(pl_module, "step_mode", None) is None:
            raise ValueError(
                f"MemberEarlyStopping(monitor={self.monitor!r}): {type(pl_module).__name__} "
                f"uses manual optimization, whose opt.step() calls phalanx cannot see, so a "
                f"stopped member would go on training. Use automatic optimization, or "
                f"StackModule(step='auto') with self.member_step(...) (it passes the mask), or "
                f"drop this callback and pass mask=self.member_mask to opt.step() yourself."
            )
        for opt in trainer.optimizers:
            if not isinstance(opt, MemberOptimizer):
                raise TypeError(
                    f"MemberEarlyStopping(monitor={self.monitor!r}): configure_optimizers "
                    f"returned {type(opt).__name__}, which cannot leave stopped members out "
                    f"of a step. Return a phalanx optimizer (phalanx.optim.SGD / Adam / ...)."
                )

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.check_on_train_epoch_end and not self.skip(trainer):
            self.check(trainer, _stack_module(pl_module, "MemberEarlyStopping"))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.check_on_train_epoch_end and not self.skip(trainer):
            self.check(trainer, _stack_module(pl_module, "MemberEarlyStopping"))

    def check(self, trainer: pl.Trainer, module: StackModule) -> None:
        """Updates each member's counter from the logged scores; masks those that stop."""
        mask = module._mask()
        n = len(mask)
        scores = self.scores(trainer, n)
        if self.wait_count is None or self.stopped_epoch is None:
            self.wait_count = torch.zeros(n, dtype=torch.long)
            self.stopped_epoch = torch.full((n,), -1, dtype=torch.long)
        better = self.improved(scores)
        assert self.best is not None
        self.best = torch.where(better, scores, self.best)
        self.wait_count = torch.where(better, 0, self.wait_count + 1)
        stop = mask.cpu() & ((self.wait_count >= self.patience) | ~scores.isfinite())
        self.stopped_epoch = torch.where(stop, trainer.current_epoch, self.stopped_epoch)
        module.member_mask = mask & ~stop.to(mask.device)
        if not bool(module.member_mask.any()):
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "patience": self.patience,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict["best"]
        self.wait_count = state_dict["wait_count"]
        self.stopped_epoch = state_dict["stopped_epoch"]


class MemberCheckpoint(_PerMember):
    """Each member's best weights in a file of its own, loadable into one member module.

    After each validation, member i's score is the logged ``f"{monitor}/member_{i}"``; when it
    improves (by more than ``min_delta``) the member's state dict is written to
    ``dirpath/member_{i:02d}.safetensors`` (atomically: a temporary file renamed), with the
    score and epoch in its metadata and in ``dirpath/members.json``. A stack with several
    stacks (an actor and a critic) writes their keys under their attribute names. The whole
    stack, optimizer and mask included, is Lightning's ``ModelCheckpoint``'s job.

    Args:
        dirpath: the folder of the member files.
        monitor: the metric's name without the ``/member_i`` suffix.
        mode: "min" or "max".
        min_delta: the smallest change that counts as an improvement.

    Attributes:
        best_epoch: (N,) the epoch of each member's saved weights, -1 before the first.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        monitor: str,
        *,
        mode: str = "min",
        min_delta: float = 0.0,
    ) -> None:
        super().__init__(monitor, mode, min_delta)
        self.dirpath = os.fspath(dirpath)
        self.best_epoch: Tensor | None = None

    def path(self, member: int) -> str:
        """The file of ``member``'s best weights."""
        return os.path.join(self.dirpath, f"member_{member:02d}.safetensors")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.skip(trainer) or not trainer.is_global_zero:
            return
        module = _stack_module(pl_module, "MemberCheckpoint")
        n = module.num_members
        scores = self.scores(trainer, n)
        better = self.improved(scores)
        assert self.best is not None
        if self.best_epoch is None:
            self.best_epoch = torch.full((n,), -1, dtype=torch.long)
        chosen = better.nonzero().flatten().tolist()
        if not chosen:
            return
        os.makedirs(self.dirpath, exist_ok=True)
        found = list(_stacks(module))
        parts = [(name, export_members(s, chosen)) for name, s in found]
        for j, i in enumerate(chosen):
            state: dict[str, Tensor] = {}
            for name, states in parts:
                prefix = f"{name}." if len(found) > 1 else ""
                state.update({prefix + k: v.contiguous() for k, v in states[j].items()})
            meta = {
                "member": str(i),
                "epoch": str(trainer.current_epoch),
                self.monitor: repr(float(scores[i])),
            }
            tmp = self.path(i) + ".tmp"
            save_file(state, tmp, metadata=meta)
            os.replace(tmp, self.path(i))
        self.best = torch.where(better, scores, self.best)
        self.best_epoch = torch.where(better, trainer.current_epoch, self.best_epoch)
        summary = [
            {
                "member": i,
                "file": os.path.basename(self.path(i)),
                "epoch": int(e),
                self.monitor: float(b),
            }
            for i, (e, b) in enumerate(zip(self.best_epoch, self.best))
            if e >= 0
        ]
        with open(os.path.join(self.dirpath, "members.json"), "w") as f:
            json.dump(summary, f, indent=1)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "dirpath": self.dirpath}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict["best"]
        self.best_epoch = state_dict["best_epoch"]


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
