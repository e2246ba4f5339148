"""The Hugging Face Trainer with a stack: members stay independent (``phalanx[hf]``).

``PhalanxTrainer`` is a ``transformers.Trainer`` for a model holding a ``phalanx.Stack`` (the
stack itself, e.g. ``phalanx.stack([GPT2LMHeadModel(config) for _ in range(8)])``, or a module
with one inside whose output's ``loss`` is the (N,) per-member losses). It runs on a
``PhalanxAccelerator`` (see ``phalanx.integrations.accelerate``), so that:

- ``max_grad_norm`` (1.0 by default) clips each member with its own norm;
- ``fp16`` scales each member's loss with its own scale (``phalanx.MemberGradScaler``): a
  member that overflows skips its own step only;
- the logs hold ``loss/member_i`` and ``grad_norm/member_i``, evaluation
  ``eval_loss/member_i`` and, with ``compute_metrics``, each metric per member
  (``eval_accuracy/member_i``), computed on member i's predictions; ``loss`` and ``eval_loss``
  are both the mean over the members of the per-member values (what is backpropagated is the
  members' sum, which gives each member its own gradient);
- ``predict`` returns the predictions members first, ``(N, B, ...)``, as the stack returns
  its outputs (``label_ids`` stay ``(B, ...)``);
- ``member_data="shuffle"`` gives each member its own order of the training set, and
  ``"bootstrap"`` its own bootstrap resample of it (drawn once, walked in a fresh order each
  epoch): the orders of ``phalanx.data.MemberLoader`` with ``seed=args.seed``. The default,
  ``"shared"``, gives every member the Trainer's batches;
- ``MemberEarlyStopping`` stops members one by one: a stopped member's weights and optimizer
  state are left as they are (the optimizer's step mask) while the others train on;
- ``save_model`` and every checkpoint write one ``save_pretrained`` folder per member
  (``member_0/``, ... which ``from_pretrained`` reads back) and the whole stack in
  ``phalanx.safetensors`` (tied weights kept), which ``resume_from_checkpoint`` and
  ``load_best_model_at_end`` read.

What the Trainer cannot keep apart is refused when the trainer is built, naming the fix.

``step="auto"`` (the default) runs each training step captured by ``phalanx.compile_step``
(forward, the members' own losses, backward, per-member clipping at ``max_grad_norm`` and
the masked optimizer update in one graph) where its own timing on the first steps keeps it,
and where the Trainer's settings leave the step to phalanx: the model is the stack itself
and computes its own loss, one step per batch (no gradient accumulation), float32 (no
``fp16``/``bf16`` autocast and scaler), one process. The Trainer's schedule, logs,
evaluation, callbacks and checkpoints go on as before: only the optimizer step it would take
after ``training_step`` is the one already taken. Elsewhere the Trainer's own eager step
runs, and the reason is logged. ``step="eager"`` keeps the Trainer's step; ``"captured"``
captures without the timing (refused where capture is not possible). ``trainer.step_choice``
and the first training log (``captured_step``: 1.0 or 0.0) say which step ran.

Member i is trained as a plain ``Trainer`` would train member i alone (same batches, same
clipping and optimizer step), to float rounding, **without dropout**: the members' dropout
masks are drawn for the stack as one computation (per backend, see the stack's randomness
notes), not from the stream the plain Trainer on that member's seed would draw, so with
dropout on a member is an equally random, not the identical, run.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import transformers
from torch import Tensor, nn
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
from transformers.trainer_utils import EvalPrediction
from transformers.utils import is_datasets_available
from transformers.utils.generic import can_return_loss, find_labels

from phalanx.checkpoint._single import load, save
from phalanx.core._stack import Stack
from phalanx.optim import SGD, AdamW, MemberOptimizer
from phalanx.population import TrainStep
from phalanx.population._step import StepMode, check_step

from ._member_callbacks import MemberEarlyStopping, per_member_metrics, tree_map
from ._member_data import MEMBER_DATA, MemberBatches, MemberCollate
from ._stacks import STACK_FILE, member_axis_first, num_members, save_members, stacks_in
from .accelerate import PhalanxAccelerator

__all__ = ["MemberEarlyStopping", "PhalanxTrainer"]

if is_datasets_available():
    import datasets

_WHERE = "phalanx.integrations.transformers.PhalanxTrainer"
logger = transformers.utils.logging.get_logger(__name__)
_ADAMW = {"adamw_torch", "adamw_torch_fused"}


class PhalanxTrainer(transformers.Trainer):
    """``transformers.Trainer`` for a model holding a phalanx stack, members kept apart.

    Takes the Trainer's arguments, and ``member_data``: ``"shared"`` (the default: every
    member the Trainer's batches), ``"shuffle"`` (each member its own order of the training
    set) or ``"bootstrap"`` (each member its own bootstrap resample), the orders of
    ``phalanx.data.MemberLoader`` with ``seed=args.seed``; with these two the model must be
    the stack itself, and ``num_items_in_batch`` (what a causal LM's loss divides by) is
    counted per member, ``(N,)``. ``model`` holds a ``phalanx.Stack`` whose output's
    ``loss`` is the (N,) per-member losses (a stack of Hugging Face models given ``labels``);
    ``optimizers=(phalanx.optim.AdamW(model.parameters(), ...), None)`` or none (then a
    phalanx AdamW from the arguments, one per member as the Trainer's own AdamW would be).
    ``step``: "auto" (the default: the captured step, ``phalanx.compile_step``, where its
    timing keeps it and the settings allow it), "captured" or "eager" (the Trainer's own
    step); ``step_backend`` is the compiler (``"aot_eager"`` builds fast, for tests).
    See the module docstring for what it does per member.

    Attributes:
        step_choice: "captured" or "eager", the step training runs once decided (None before).

    Raises:
        ValueError: at construction, for what would couple the members: no stack in the
            model, a torch optimizer (no per-member step mask), an ``optim`` other than
            AdamW or SGD, DeepSpeed, FSDP, ``label_smoothing_factor`` (the Trainer's smoother
            averages over members), ``reduce_lr_on_plateau`` (one metric for all members),
            several GPUs in one process (DataParallel).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: transformers.TrainingArguments | None = None,
        *,
        compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None = None,
        member_data: str = "shared",
        step: StepMode = "auto",
        step_backend: str = "inductor",
        **kwargs: Any,
    ) -> None:
        self.step_mode = check_step(step, f"{_WHERE}()")
        self.step_backend = step_backend
        self.step_choice: str | None = None
        self._train_step: TrainStep | None = None
        self._step_taken = False  # the captured (or phalanx's) step already updated the members
        self._step_logged = False
        if member_data not in MEMBER_DATA:
            raise ValueError(
                f"{_WHERE}(): member_data={member_data!r}; choose 'shared' (every member the "
                f"Trainer's batches), 'shuffle' (each member its own order) or 'bootstrap' "
                f"(each member its own resample)."
            )
        if member_data != "shared" and not isinstance(model, Stack):
            raise ValueError(
                f"{_WHERE}(): member_data={member_data!r} feeds the stack per-member batches "
                f"(N, B, ...) as keyword inputs with kw_in_dims=0, so the model must be the "
                f"stack itself; got a {type(model).__name__}. Pass phalanx.stack([...]) as "
                f"model, or feed per-member batches to your wrapper yourself."
            )
        self.member_data = member_data
        if model is None or not stacks_in(model):
            raise ValueError(
                f"{_WHERE}(): model must hold a phalanx stack (phalanx.stack([...]) or a module "
                f"with one inside); got {type(model).__name__}. For one model use "
                f"transformers.Trainer; model_init (hyperparameter search) is not supported."
            )
        self.num_members = num_members(stacks_in(model), f"{_WHERE}()")
        if args is not None and args.label_smoothing_factor:  # the Trainer reads it at once
            raise ValueError(
                f"{_WHERE}(): label_smoothing_factor={args.label_smoothing_factor}: the Trainer's "
                "smoother would average the stacked logits over all members. Compute the loss per "
                "member in the model with phalanx.member_losses(F.cross_entropy, logits, labels, "
                "label_smoothing=...) and return it as the output's loss."
            )
        self._user_metrics = compute_metrics
        wrapped = per_member_metrics(compute_metrics, self.num_members) if compute_metrics else None
        super().__init__(model, args, compute_metrics=wrapped, **kwargs)
        self._refuse_coupling()
        if isinstance(model, Stack):  # read the members' forward, as the Trainer reads a model's
            self._member = model.module
            forward = inspect.signature(type(self._member).forward).parameters
            self.model_accepts_loss_kwargs = getattr(
                self._member,
                "accepts_loss_kwargs",
                any(k.kind == inspect.Parameter.VAR_KEYWORD for k in forward.values()),
            )
            if self.args.label_names is None:
                self.label_names = find_labels(type(self._member))
            self.can_return_loss = can_return_loss(type(self._member))
            # how the Trainer counts a batch's items for a causal LM's loss, as for one member
            mapping: dict[Any, Any] = LOSS_MAPPING
            self._loss_shifts_labels = mapping.get(
                getattr(self._member, "loss_type", None)
            ) is ForCausalLMLoss and not getattr(
                getattr(self._member, "config", None), "is_encoder_decoder", False
            )
        n = self.num_members
        self._member_tr_loss = torch.zeros(n, dtype=torch.float64)
        self._member_steps = 0  # optimizer steps since the last log
        self._member_grad_norm: Tensor | None = None
        self._eval_loss_sum = torch.zeros(n, dtype=torch.float64)
        self._eval_count = 0
        self._last_losses: Tensor | None = None
        self._moved_leaves: list[bool] = []  # which predictions prediction_step moved
        self._takes_use_cache = _takes_use_cache(model)
        self.accelerator.member_mask_fn = self.member_mask

    # ------------------------------------------------------------------------- set-up

    def _refuse_coupling(self) -> None:
        args = self.args
        problems = []
        if args.deepspeed or self.is_deepspeed_enabled:
            problems.append(
                "DeepSpeed runs its own clipping, loss scaling and optimizer over all parameters "
                "as one model: train without deepspeed= (phalanx.distributed spreads members "
                "over processes)"
            )
        if args.fsdp or self.is_fsdp_enabled:
            problems.append("FSDP shards the stacked parameters as one model: train without fsdp=")
        if _value(args.lr_scheduler_type) == "reduce_lr_on_plateau":
            problems.append(
                "lr_scheduler_type='reduce_lr_on_plateau' watches one metric for all members: "
                "pass optimizers=(opt, None) and step phalanx.optim.MemberScheduler(opt, lambda o: "
                "ReduceLROnPlateau(o, ...)) with per-member metrics from a callback"
            )
        if args.n_gpu > 1:
            problems.append(
                f"{args.n_gpu} GPUs in one process (torch DataParallel): run one process per GPU "
                "(torchrun), or use phalanx.distributed"
            )
        optimizer = self.optimizer
        if optimizer is not None and not isinstance(optimizer, MemberOptimizer):
            problems.append(
                f"the optimizer is a {type(optimizer).__name__}, whose step cannot leave out "
                "stopped or overflowing members: pass optimizers=(phalanx.optim.AdamW("
                "model.parameters(), lr=...), None)"
            )
        if optimizer is None and _value(args.optim) not in _ADAMW | {"sgd"}:
            problems.append(
                f"optim={_value(args.optim)!r} has no phalanx optimizer: use optim='adamw_torch' or "
                "'sgd', or pass optimizers=(phalanx.optim.Adam(model.parameters(), ...), None)"
            )
        if problems:
            raise ValueError(
                f"{_WHERE}(): these settings would train the {self.num_members} members as one "
                "model:\n  - " + "\n  - ".join(problems)
            )

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None and isinstance(self.model, Stack):
            forward = inspect.signature(type(self.model.module).forward)
            columns: Any = [*forward.parameters, "label", "label_ids", *self.label_names]
            self._signature_columns = columns
        super()._set_signature_columns_if_needed()

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        self._accelerator_args = super()._build_accelerator_args(**kwargs)
        return self._accelerator_args

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's set-up, on a ``PhalanxAccelerator`` built with the same arguments."""
        super().create_accelerator_and_postprocess()
        self.accelerator = PhalanxAccelerator(**self._accelerator_args)
        self.gather_function = self.accelerator.gather_for_metrics
        if self.model is not None:  # the stacks and the per-member scaler, before prepare()
            self.accelerator._add_stacks(self.model)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The given phalanx optimizer, or a phalanx AdamW (SGD) from the arguments, with the
        Trainer's weight-decay groups."""
        if self.optimizer is None:
            model = self.model if model is None else model
            assert model is not None  # the constructor refuses a trainer without a model
            decay = set(self.get_decay_parameter_names(model))
            named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
            groups = [
                {
                    "params": [p for k, p in named if k in decay],
                    "weight_decay": self.args.weight_decay,
                },
                {"params": [p for k, p in named if k not in decay], "weight_decay": 0.0},
            ]
            groups = [g for g in groups if g["params"]]
            if _value(self.args.optim) == "sgd":
                self.optimizer = SGD(groups, lr=self.args.learning_rate)
            else:
                self.optimizer = AdamW(
                    groups,
                    lr=self.args.learning_rate,
                    betas=(self.args.adam_beta1, self.args.adam_beta2),
                    eps=self.args.adam_epsilon,
                )
        return self.optimizer

    def get_train_dataloader(self) -> Any:
        """The Trainer's loader, or with ``member_data`` one of per-member batches: every
        tensor ``(N, B, ...)``, member i's rows from its own order (``MemberLoader``'s)."""
        if self.member_data == "shared":
            return super().get_train_dataloader()
        if self.train_dataset is None:
            raise ValueError(f"{_WHERE}: training requires a train_dataset.")
        dataset: Any = self.train_dataset
        collate = self.data_collator
        if is_datasets_available() and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        batches = MemberBatches(
            len(dataset),
            self.num_members,
            self._train_batch_size,
            bootstrap=self.member_data == "bootstrap",
            seed=self.args.seed,
        )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=batches,
            collate_fn=MemberCollate(collate, self.num_members),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )
        return self.accelerator.prepare(loader)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """The Trainer's count of the batches' label items; with ``member_data``, one count
        per member, ``(N,)`` (each member's loss divides by its own items, as alone)."""
        count = super()._get_num_items_in_batch(batch_samples, device)
        if self.member_data == "shared" or count is None:
            return count
        per_member = 0
        for batch in batch_samples:
            labels = batch["labels"]
            if "shift_labels" in batch:
                labels = batch["shift_labels"]
            elif self._loss_shifts_labels:
                labels = labels[..., 1:]
            per_member = per_member + labels.ne(-100).sum(dim=tuple(range(1, labels.dim())))
        return per_member

    def member_mask(self) -> Tensor | None:
        """(N,) bool, the members still training (every ``MemberEarlyStopping``'s), or None."""
        stoppers = [
            c for c in self.callback_handler.callbacks if isinstance(c, MemberEarlyStopping)
        ]
        if not stoppers:
            return None
        mask = torch.ones(self.num_members, dtype=torch.bool)
        for stopper in stoppers:
            mask &= stopper.mask(self.num_members)
        return mask.to(self.args.device)

    # ---------------------------------------------------------------------- training

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The (N,) per-member losses: the output's ``loss`` (or ``compute_loss_func``'s)."""
        inputs = dict(inputs)
        if self._takes_use_cache and "use_cache" not in inputs:
            inputs["use_cache"] = False  # training never reads a cache; a stack cannot hold one
        labels = (
            inputs.pop("labels")
            if self.compute_loss_func is not None and "labels" in inputs
            else None
        )
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            inputs["num_items_in_batch"] = num_items_in_batch
        per_member = self.member_data != "shared" and model.training
        outputs = model(**inputs, kw_in_dims=0) if per_member else model(**inputs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif isinstance(outputs, dict):
            if "loss" not in outputs:
                raise ValueError(
                    f"{_WHERE}.compute_loss(): the model returned no loss, only {list(outputs)}; "
                    f"pass labels (a column 'labels') or have the model return the (N,) losses."
                )
            loss = outputs["loss"]
        else:
            loss = outputs[0]
        if not isinstance(loss, Tensor) or loss.shape != (self.num_members,):
            got = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"{_WHERE}.compute_loss(): the loss must be the per-member losses, shape "
                f"({self.num_members},), so that each member is clipped, scaled, logged and "
                f"stopped on its own; got {got}. Return phalanx.member_losses(...) (or a stack's "
                f"out.loss), not their sum."
            )
        self._last_losses = loss.detach()
        return (loss, outputs) if return_outputs else loss

    def why_eager(self) -> str | None:
        """Why the Trainer's settings leave the step to the Trainer (its eager step), or None
        where phalanx's step (captured, with ``step="auto"`` or ``"captured"``) can run."""
        args = self.args
        if not isinstance(self.model, Stack):
            return (
                f"the model is a {type(self.model).__name__} around the stack; compile_step "
                "captures a phalanx.Stack's step (pass the stack itself as model)"
            )
        if self.compute_loss_func is not None:
            return "compute_loss_func computes the loss on the stacked outputs"
        if type(self).compute_loss is not PhalanxTrainer.compute_loss:
            return "compute_loss is overridden"
        if args.gradient_accumulation_steps != 1:
            return (
                f"gradient_accumulation_steps={args.gradient_accumulation_steps} sums "
                "gradients over several batches before one optimizer step"
            )
        if args.fp16 or args.bf16:
            return "fp16/bf16 run the Trainer's autocast and loss scaler"
        if args.world_size > 1 or self.accelerator.num_processes > 1:
            return "several processes: DDP averages the gradients in the Trainer's backward"
        if not isinstance(self.optimizer, MemberOptimizer) and not isinstance(
            getattr(self.optimizer, "optimizer", None), MemberOptimizer
        ):
            return "the optimizer is not a phalanx optimizer"
        if self.lr_scheduler is not None and isinstance(
            self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
        ):
            return "ReduceLROnPlateau"
        return None

    def _phalanx_step(self) -> TrainStep | None:
        """The step phalanx runs in ``training_step`` (built at the first), or None (the
        Trainer's step: ``step="eager"``, or settings that leave the step to the Trainer)."""
        if self._train_step is not None or self.step_choice == "eager":
            return self._train_step
        why = None if self.step_mode == "eager" else self.why_eager()
        if self.step_mode == "captured" and why is not None:
            raise ValueError(
                f"{_WHERE}(step='captured'): the captured step cannot run here: {why}. Use "
                f"step='auto' (the Trainer's step where capture is not possible) or 'eager'."
            )
        if self.step_mode == "eager" or why is not None:
            self._chosen("eager", why or "step='eager'")
            return None
        model: Any = self.model
        optimizer: Any = getattr(self.optimizer, "optimizer", self.optimizer)
        per_member = self.member_data != "shared"
        self._train_step = TrainStep(
            model,
            None,  # the loss each member computes itself, its output's .loss
            optimizer,
            step=self.step_mode,
            kw_in_dims=0 if per_member else None,
            target_in_dims=None,
            # inf: no clipping, but the norms the Trainer logs without max_grad_norm
            max_norm=self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf"),
            backend=self.step_backend,
            on_choice=lambda choice: self._chosen(choice, None),
            where=f"{_WHERE}.training_step()",
        )
        return self._train_step

    def _chosen(self, choice: str, why: str | None) -> None:
        self.step_choice = choice
        self._step_logged = False
        report = self._train_step.report if self._train_step is not None else why
        logger.warning(f"{_WHERE}: training runs the {choice} step ({report}).")

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        """The Trainer's step on the (N,) losses (their sum is backpropagated), or phalanx's
        whole step (captured where faster, see ``step``); returns their mean, what the Trainer
        logs as ``loss`` (on the footing of ``eval_loss``, the mean of the members' losses),
        and keeps each member's for ``loss/member_i``."""
        step = self._phalanx_step()
        if step is None:
            losses = super().training_step(model, inputs, num_items_in_batch)
        else:
            model.train()
            inputs = dict(self._prepare_inputs(inputs))
            if self._takes_use_cache and "use_cache" not in inputs:
                inputs["use_cache"] = False
            if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
                inputs["num_items_in_batch"] = num_items_in_batch
            losses = step((), mask=self.member_mask(), **inputs)
            self._step_taken = True
            self.accelerator._step_taken = True  # the prepared optimizer's step is this one
        self._member_tr_loss += losses.detach().double().cpu()
        return losses.mean()

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        if self._step_taken:  # clipped inside the step, each member by its own norm
            return self._train_step.last_norms if self._train_step is not None else None
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self._step_taken:
            self._step_taken = False
            grad_norm = self._train_step.last_norms if self._train_step is not None else None
            norms = grad_norm
        else:
            norms = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._member_steps += 1  # called once per optimizer step
        if isinstance(norms, Tensor) and norms.shape == (self.num_members,):
            self._member_grad_norm = norms.detach().double().cpu()
            return None  # logged per member, as grad_norm/member_i
        return norms

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds ``loss/member_i`` and ``grad_norm/member_i`` to the training logs, and, once
        the step is chosen, ``captured_step`` (1.0 captured, 0.0 eager)."""
        if "loss" in logs and not any(k.startswith("eval_") for k in logs):
            if self.step_choice is not None and not self._step_logged:
                logs["captured_step"] = float(self.step_choice == "captured")
                self._step_logged = True
            steps = max(self._member_steps, 1)
            for i, value in enumerate((self._member_tr_loss / steps).tolist()):
                logs[f"loss/member_{i}"] = value
            self._member_tr_loss.zero_()
            self._member_steps = 0
            if self._member_grad_norm is not None:
                for i, value in enumerate(self._member_grad_norm.tolist()):
                    logs[f"grad_norm/member_{i}"] = value
        super().log(logs, start_time)

    # --------------------------------------------------------------------- evaluation

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[Tensor | None, Any, Any]:
        """The Trainer's step; keeps each member's loss and puts the member axis of the
        predictions second, (B, N, ...), so that batches concatenate along the samples
        (``predict`` puts it first again)."""
        self._last_losses = None
        inputs = dict(inputs)
        if self._takes_use_cache and "use_cache" not in inputs:
            inputs["use_cache"] = False
        loss, logits, labels = super().prediction_step(
            model, inputs, prediction_loss_only, ignore_keys
        )
        if self._last_losses is not None:
            batch = transformers.trainer_pt_utils.find_batch_size(inputs)
            self._eval_loss_sum += self._last_losses.double().cpu() * batch
            self._eval_count += batch
        n = self.num_members
        moved: list[bool] = []

        def member_second(t: Any) -> Any:
            moved.append(member_axis_first(t, n))
            return t.movedim(0, 1) if moved[-1] else t

        logits = tree_map(member_second, logits)
        self._moved_leaves = moved
        return loss, logits, labels

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> Any:
        """The Trainer's ``predict``, with the predictions members first, ``(N, B, ...)``, as
        the stack returns its outputs (the Trainer's own order would be ``(B, N, ...)``: it
        concatenates batches along dim 0); ``label_ids`` stay ``(B, ...)`` and the metrics
        are per member, ``{prefix}_loss/member_i``."""
        self._moved_leaves = []
        output = super().predict(test_dataset, ignore_keys, metric_key_prefix)
        flags = iter(self._moved_leaves)

        def member_first(a: Any) -> Any:
            return np.moveaxis(a, 1, 0) if next(flags, False) and a is not None else a

        return output._replace(predictions=tree_map(member_first, output.predictions))

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        """The Trainer's loop, plus ``{prefix}_loss/member_i``."""
        self._eval_loss_sum.zero_()
        self._eval_count = 0
        output = super().evaluation_loop(
            dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
        )
        metrics: Any = output.metrics
        if self._eval_count:
            for i, value in enumerate((self._eval_loss_sum / self._eval_count).tolist()):
                metrics[f"{metric_key_prefix}_loss/member_{i}"] = value
        return output

    # -------------------------------------------------------------------- checkpoints

    def _save(
        self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None
    ) -> None:
        """One ``save_pretrained`` folder per member and the stack in ``phalanx.safetensors``
        (the Trainer's safetensors file refuses tied weights)."""
        output_dir = str(output_dir if output_dir is not None else self.args.output_dir)
        os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model)
        save(os.path.join(output_dir, STACK_FILE), model)
        # save() leaves its lock file (.phalanx.safetensors.lock) for concurrent savers of one
        # path; the Trainer saves from one process (args.should_save), so a model folder
        # holds only what from_pretrained and resume read.
        lock = os.path.join(output_dir, f".{STACK_FILE}.lock")
        if os.path.exists(lock):
            os.remove(lock)
        save_members(model, output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        path = os.path.join(resume_from_checkpoint, STACK_FILE)
        if not os.path.isfile(path):
            raise ValueError(
                f"{_WHERE}: {resume_from_checkpoint!r} holds no {STACK_FILE}; resume from a "
                f"checkpoint a PhalanxTrainer wrote."
            )
        load(path, self.accelerator.unwrap_model(model if model is not None else self.model))
        self._restore_stopped_members(resume_from_checkpoint)

    def _restore_stopped_members(self, checkpoint: str) -> None:
        """Which members stopped, from the checkpoint, whatever
        ``restore_callback_states_from_checkpoint`` says: a stopped member must stay masked."""
        state_file = os.path.join(checkpoint, transformers.trainer.TRAINER_STATE_NAME)
        if not os.path.isfile(state_file):
            return
        saved = transformers.TrainerState.load_from_json(state_file).stateful_callbacks
        data = saved.get(MemberEarlyStopping.__name__, [])
        data = data if isinstance(data, list) else [data]
        stoppers = [
            c for c in self.callback_handler.callbacks if isinstance(c, MemberEarlyStopping)
        ]
        for stopper, entry in zip(stoppers, data):
            for attribute, value in entry.get("attributes", {}).items():
                setattr(stopper, attribute, value)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is not None:
            self._load_from_checkpoint(best)


def _value(option: Any) -> str:
    """A TrainingArguments enum's string ("adamw_torch"), or the string itself."""
    return str(getattr(option, "value", option))


def _takes_use_cache(model: nn.Module) -> bool:
    for stack in stacks_in(model):
        config = getattr(stack.module, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            return stack is model  # a wrapper passes only what its forward takes
    return False


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
