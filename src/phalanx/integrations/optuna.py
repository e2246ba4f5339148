"""Optuna: N trials asked at once and trained as one stack, each told its own result.

``optimize(study, model, train, n_trials=...)`` replaces ``study.optimize(objective, ...)`` for a
search whose trials train networks. It asks a batch of trials from the study's sampler
(``study.ask()``, any sampler), lets ``model(trial)`` suggest each trial's values and build its
network under the trial's own seed, groups the trials whose networks can share a stack (one
architecture, and equal values of the parameters named in ``group_by``, e.g. the batch size),
and calls ``train(group)`` once per group. ``train`` trains ``group.stack`` with the trials' values
as per-member hyperparameters (``group.params["lr"]`` is one value per member, what
``phalanx.optim`` takes), reports intermediate values with ``group.report(values, step)``, which
asks the study's pruner for every trial and returns the mask of members still running, and
returns the final values. Every trial is then told its result: COMPLETE with its value, PRUNED
when the pruner stopped it, FAIL when its value was not finite.

A trial's network, data stream and so its result depend only on the study seed and the
trial's number, so a trial trained in a stack of 64 gets what it gets trained alone
(``N = 1``, or Optuna's own trial-by-trial loop with the same seeds), to float rounding,
without dropout: with dropout in training the masks come from the stack's backend (the loop
backend draws as each member alone would; ``vmap`` and ``fused`` draw all members at once,
independent per member but other numbers), so a trial is then an equally random run, not the
identical one.

Trials whose networks differ in a module setting (a width, an activation's slope) cannot
share a stack: a batch that falls apart so says it with a ``StackSplitWarning`` naming the
difference. A dropout rate is not such a setting: ``nn.Dropout``'s (and ``Dropout1d/2d/3d``'s)
``p`` is a per-member value of the stack, as a learning rate is, so a rate from
``suggest_float`` keeps the batch one stack, each trial training at its own rate
(``AlphaDropout``'s rate still splits: suggest it from a few values).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
import torch
from optuna.trial import Trial, TrialState
from torch import Tensor, nn

from phalanx._warnings import StackSplitWarning, warn
from phalanx.core._build import stack as build_stack
from phalanx.core._stack import Stack
from phalanx.core._validate import architecture_differences
from phalanx.data import MemberLoader
from phalanx.integrations._progress import progress_bar
from phalanx.optim import MemberOptimizer
from phalanx.population import TrainStep, keep_members
from phalanx.population._step import StepMode, check_step, recording

from ._stacks import describe_split

__all__ = ["StackSplitWarning", "TrialGroup", "build_model", "optimize", "trial_loader"]


def build_model(model: Callable[[Trial], nn.Module], trial: Trial, seed: int) -> nn.Module:
    """``model(trial)`` run under the trial's own seed, ``seed + trial.number``.

    The global random state is restored afterwards. A trial-by-trial objective that builds its
    network with this function starts from the weights the trial gets in a stack.

    Raises:
        TypeError: ``model`` returned something other than an ``nn.Module``.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + trial.number)
        net = model(trial)
    if not isinstance(net, nn.Module):
        raise TypeError(
            "phalanx.integrations.optuna: model(trial) must suggest the trial's values and "
            f"return its nn.Module; it returned {type(net).__name__} for trial {trial.number}."
        )
    return net


def trial_loader(
    *tensors: Tensor, trial_numbers: Sequence[int], batch_size: int, seed: int, **kwargs: Any
) -> MemberLoader:
    """A ``MemberLoader`` whose member i reads the data stream of trial ``trial_numbers[i]``.

    A trial's batches then depend only on ``seed`` and its number: the same in a stack of any
    size and in a one-member loader `MemberLoader(..., num_members=1,
    first_member=trial.number, seed=seed)`.

    Args:
        *tensors: the data tensors, as for ``MemberLoader``.
        trial_numbers: one Optuna trial number per member.
        batch_size, seed, **kwargs: as for ``MemberLoader``.
    """
    numbers = [int(k) for k in trial_numbers]
    loader = MemberLoader(
        *tensors, num_members=len(numbers), batch_size=batch_size, seed=seed, **kwargs
    )
    loader.set_streams(list(range(len(numbers))), numbers)
    return loader


@dataclass
class TrialGroup:
    """Trials that share one stack: member i is ``trials[i]``.

    Attributes:
        trials: the Optuna trials, in member order.
        stack: the N networks ``model(trial)`` built, stacked (members dropped by ``keep_live``
            leave it).
        seed: the study seed; trial k's network and data depend on ``seed`` and k only.
        live: (N,) bool, the members neither pruned nor failed.
        failed: (N,) bool, the members whose reported value was not finite.
        step: the training step ``train_step`` builds: "auto", "captured" or "eager"
            (``optimize``'s ``step=``).
        step_choice: the step the group's ``train_step`` ran ("captured" or "eager"), None
            before it decided.
    """

    trials: list[Trial]
    stack: Stack
    seed: int
    step: StepMode = "auto"
    step_choice: str | None = field(init=False, default=None)
    live: Tensor = field(init=False)
    failed: Tensor = field(init=False)
    last: list[float | None] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.trials)
        self.live = torch.ones(n, dtype=torch.bool)
        self.failed = torch.zeros(n, dtype=torch.bool)
        self.last = [None] * n

    def __len__(self) -> int:
        return len(self.trials)

    @property
    def mask(self) -> Tensor | None:
        """The optimizer step's ``mask=``: None while every member is live (the unmasked
        step), else ``live``."""
        return None if bool(self.live.all()) else self.live.clone()

    @property
    def numbers(self) -> list[int]:
        """The trials' numbers, in member order."""
        return [t.number for t in self.trials]

    @property
    def params(self) -> dict[str, list[Any]]:
        """Each suggested parameter's values, one per member: ``params["lr"][i]`` is trial i's.

        Raises:
            KeyError: a parameter not every trial of the group suggested (the message names
                the trials that lack it).
        """
        names = dict.fromkeys(k for t in self.trials for k in t.params)
        out: dict[str, list[Any]] = {}
        for name in names:
            lacking = [t.number for t in self.trials if name not in t.params]
            if lacking:
                raise KeyError(
                    f"TrialGroup.params: trials {lacking} did not suggest {name!r}; suggest it "
                    "in every trial, or name it in group_by= so those trials get their own stack."
                )
            out[name] = [t.params[name] for t in self.trials]
        return out

    def loader(self, *tensors: Tensor, batch_size: int, **kwargs: Any) -> MemberLoader:
        """A ``MemberLoader`` in which each member reads its own trial's data stream.

        See ``trial_loader``; ``seed`` is the study seed.
        """
        return trial_loader(
            *tensors, trial_numbers=self.numbers, batch_size=batch_size, seed=self.seed, **kwargs
        )

    def train_step(
        self,
        loss_fn: Callable[..., Tensor] | None,
        optimizer: MemberOptimizer,
        **kwargs: Any,
    ) -> TrainStep:
        """The group's training step, captured where ``compile_step`` measures it faster.

        ``losses = step(xb, yb, mask=group.mask)`` zeroes the gradients, runs the forward,
        ``member_losses``, backward (clipping with ``max_norm=``) and ``optimizer.step``: the
        captured step (``phalanx.compile_step``) or the eager one as ``optimize(...,
        step=)`` says; ``step_choice`` and the progress bar's postfix say which ran. It
        follows ``stack`` through ``keep_live``.

        Args:
            loss_fn: as for :func:`phalanx.compile_step` (``F.cross_entropy``).
            optimizer: the group's phalanx optimizer over ``stack.parameters()``.
            **kwargs: ``compile_step``'s ``in_dims``, ``target_in_dims``, ``kw_in_dims``,
                ``max_norm``, ``norm_type``, ``backend``; ``step=`` overrides the search's.
        """

        def chosen(choice: str) -> None:
            self.step_choice = choice

        kwargs.setdefault("step", self.step)
        return TrainStep(lambda: self.stack, loss_fn, optimizer, on_choice=chosen,
                         where="TrialGroup.train_step()", **kwargs)  # fmt: skip

    def report(self, values: Any, step: int) -> Tensor:
        """Reports each running member's value at ``step`` and asks the pruner about it.

        A member whose value is not finite fails (its trial is told FAIL); one the pruner
        stops is pruned (told PRUNED). Neither is reported again.

        Args:
            values: (N,) one intermediate value per member (a tensor or a sequence).
            step: the step the values belong to, as for ``optuna.Trial.report``.

        Returns:
            (N,) bool: ``live``, the members still running; pass it as the optimizer step's
            ``mask=``, or drop the others with ``keep_live``.

        Raises:
            ValueError: not one value per member.
        """
        flat = _values(values, len(self), "TrialGroup.report()")
        for i, (trial, v) in enumerate(zip(self.trials, flat)):
            if not self.live[i]:
                continue
            if not math.isfinite(v):
                self.live[i], self.failed[i] = False, True
                continue
            self.last[i] = v
            trial.report(v, step)
            if trial.should_prune():
                self.live[i] = False
        return self.live.clone()

    def keep_live(
        self,
        stack: Stack,
        *,
        optimizer: MemberOptimizer | None = None,
        loader: MemberLoader | None = None,
    ) -> Stack:
        """A stack of the live members only; the group, optimizer and loader follow it.

        Dropped trials keep their verdict (PRUNED or FAIL) and leave ``trials``, ``live``,
        ``failed`` and ``stack``; the rest train on exactly as before, at the cost of a smaller
        stack (``phalanx.population.keep_members``).

        Returns:
            The smaller stack (also ``self.stack``); ``stack`` itself when every member is live.

        Raises:
            ValueError: no member is live (check ``live.any()`` first).
        """
        index = self.live.nonzero().flatten().tolist()
        if len(index) == len(self):
            return stack
        if not index:
            raise ValueError(
                "TrialGroup.keep_live(): no member is live; stop training this group "
                "(`if not group.live.any(): break`)."
            )
        self._finish_dropped([i for i in range(len(self)) if i not in index])
        small = keep_members(stack, index, optimizer=optimizer, loader=loader)
        self.trials = [self.trials[i] for i in index]
        self.last = [self.last[i] for i in index]
        self.live = self.live[index]
        self.failed = self.failed[index]
        self.stack = small
        return small

    # ------------------------------------------------------------------------------ telling

    def _finish_dropped(self, index: list[int]) -> None:
        self._dropped = [*getattr(self, "_dropped", []), *(self._verdict(i) for i in index)]

    def _verdict(
        self, i: int, final: float | None = None
    ) -> tuple[Trial, TrialState, float | None]:
        trial = self.trials[i]
        if self.failed[i]:
            return trial, TrialState.FAIL, None
        if not self.live[i]:
            return trial, TrialState.PRUNED, None
        if final is None or not math.isfinite(final):
            return trial, TrialState.FAIL, None
        return trial, TrialState.COMPLETE, final

    def _tell(self, study: optuna.Study, finals: list[float] | None) -> None:
        told = list(getattr(self, "_dropped", []))
        told += [self._verdict(i, None if finals is None else finals[i]) for i in range(len(self))]
        self._dropped = []
        for trial, state, value in told:
            if state is TrialState.COMPLETE:
                _tell(study, trial, value)
            else:
                _tell(study, trial, state=state)


def _tell(study: optuna.Study, trial: Trial, *args: Any, **kwargs: Any) -> None:
    """``study.tell`` as inside ``study.optimize``: a sampler that calls ``study.stop()``
    (GridSampler, in ``after_trial`` once its grid is used up) ends the search after the
    running batch, as Optuna's own loop ends, instead of raising from ``tell``. Optuna keeps
    that state in private attributes (``_thread_local.in_optimize_loop``, ``_stop_flag``:
    optuna 3 to 5); without them ``stop()`` raises as before."""
    local = getattr(study, "_thread_local", None)
    if local is None or not hasattr(local, "in_optimize_loop") or not hasattr(study, "_stop_flag"):
        study.tell(trial, *args, **kwargs)
        return
    outer = local.in_optimize_loop
    local.in_optimize_loop = True
    try:
        study.tell(trial, *args, **kwargs)
    finally:
        local.in_optimize_loop = outer


def _stop_requested(study: optuna.Study, *, reset: bool = False) -> bool:
    """Whether a sampler called ``study.stop()`` during a ``_tell`` (see there)."""
    if reset and hasattr(study, "_stop_flag"):
        study._stop_flag = False
    return bool(getattr(study, "_stop_flag", False))


def _known_names(
    study: optuna.Study, trials: list[Trial], group_by: Sequence[str], where: str
) -> None:
    """Refuses ``group_by`` names that no trial of the batch suggested (a misspelling would
    group nothing), telling the batch's trials FAIL first."""
    unknown = [n for n in group_by if not any(n in t.params for t in trials)]
    if not unknown:
        return
    for t in trials:
        _tell(study, t, state=TrialState.FAIL)
    suggested = sorted({n for t in trials for n in t.params})
    raise ValueError(
        f"{where}: group_by names {unknown}, which no trial suggested (the trials suggested "
        f"{suggested}); name parameters that model(trial) suggests with trial.suggest_*()."
    )


def _values(values: Any, n: int, where: str) -> list[float]:
    flat = (
        values.detach().double().flatten().tolist()
        if isinstance(values, Tensor)
        else [float(v) for v in values]
    )
    if len(flat) != n:
        raise ValueError(
            f"{where}: expected one value per member ({n}); got {len(flat)}. Return or report "
            "an (N,) tensor with member i's value at index i."
        )
    return flat


def _group(
    trials: list[Trial], nets: list[nn.Module], group_by: Sequence[str]
) -> list[tuple[list[Trial], list[nn.Module]]]:
    """Trials whose networks share one architecture and whose ``group_by`` values are equal."""
    groups: list[tuple[tuple[Any, ...], list[Trial], list[nn.Module]]] = []
    for trial, net in zip(trials, nets):
        key = tuple(trial.params.get(name) for name in group_by)
        for gkey, gtrials, gnets in groups:
            if gkey == key and not architecture_differences(gnets[0], net, len(gnets)):
                gtrials.append(trial)
                gnets.append(net)
                break
        else:
            groups.append((key, [trial], [net]))
    return [(t, m) for _, t, m in groups]


def _announce_split(
    groups: list[tuple[list[Trial], list[nn.Module]]], group_by: Sequence[str], where: str
) -> None:
    """Warns (``StackSplitWarning``) where networks of one ``group_by`` key made several
    stacks: an architecture setting (a width, an AlphaDropout's rate) varies across the batch."""
    by_key: dict[tuple[Any, ...], list[list[nn.Module]]] = {}
    for trials, nets in groups:
        key = tuple(trials[0].params.get(name) for name in group_by)
        by_key.setdefault(key, []).append(nets)
    for nets_groups in by_key.values():
        message = describe_split(nets_groups, where)
        if message is not None:
            warn(message, StackSplitWarning)
            return


def optimize(
    study: optuna.Study,
    model: Callable[[Trial], nn.Module],
    train: Callable[[TrialGroup], Any],
    *,
    n_trials: int,
    n_members: int | None = None,
    group_by: Sequence[str] = (),
    seed: int = 0,
    stack_kwargs: dict[str, Any] | None = None,
    progress: bool | None = None,
    step: StepMode = "auto",
) -> list[TrialGroup]:
    """Runs ``n_trials`` more trials of ``study``, ``n_members`` at a time, each group one stack.

    Args:
        study: any Optuna study (any sampler, pruner and storage; a study loaded from its
            storage continues where it stopped: trial numbers, and so seeds, go on).
        model: ``model(trial)`` suggests the trial's values (``trial.suggest_float(...)``) and
            returns its network; it runs under ``torch.manual_seed(seed + trial.number)``.
        train: ``train(group)`` trains ``group.stack`` (see ``TrialGroup``) and returns the final
            value of each member, (N,); members pruned or failed on the way may hold anything.
        n_trials: trials to run (asked in batches of ``n_members``).
        n_members: trials asked at once (default: all ``n_trials``).
        group_by: parameter names whose values cannot vary within one stack (a batch size, a
            data choice); networks of different architectures (a width, a depth) get
            different stacks automatically, announced by a ``StackSplitWarning`` that names
            the difference. A Dropout's rate is per member and keeps one stack.
        seed: the study seed of the networks and the data streams.
        stack_kwargs: passed to ``phalanx.stack`` (e.g. ``{"backend": "vmap"}``).
        progress: a progress bar of the trials told, on standard error (tqdm): None (the
            default) shows it when standard error is a terminal; True or False to choose.
        step: the training step ``group.train_step(...)`` builds: "auto" (the default: the
            captured step, ``phalanx.compile_step``, where its own timing keeps it, else the
            eager one), "captured" or "eager". The bar's postfix (``step=captured``), each
            group's ``step_choice`` and the ``phalanx`` logger say which ran.

    A sampler that stops the study (``GridSampler`` once its grid is used up calls
    ``study.stop()``) ends the search after the running batch, as ``study.optimize`` ends
    after its running trials.

    Returns:
        The trained groups, in order (each holds its trials and trained stack).

    Raises:
        ValueError: ``n_trials`` or ``n_members`` not a positive int, ``train`` did not return
            one value per member, a study with several objectives, or a ``group_by`` name
            that no trial of a batch suggested (that batch's trials are told FAIL).
        Exception: whatever ``train`` raised; that group's unfinished trials are told FAIL first.

    Example:
        >>> import optuna
        >>> import phalanx.integrations.optuna as po
        >>> X, Y = torch.randn(64, 4), torch.randint(0, 2, (64,))
        >>> def model(trial):
        ...     trial.suggest_float("lr", 1e-3, 1e-1, log=True)
        ...     return nn.Linear(4, 2)
        >>> def train(group):
        ...     opt = phalanx.optim.SGD(group.stack.parameters(), lr=group.params["lr"])
        ...     for xb, yb in group.loader(X, Y, batch_size=16):
        ...         out = group.stack(xb, in_dims=0)
        ...         losses = phalanx.member_losses(F.cross_entropy, out, yb, in_dims=(0, 0))
        ...         opt.zero_grad(); losses.sum().backward(); opt.step()
        ...     return phalanx.metrics.loss(F.cross_entropy, group.stack(X), Y)
        >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
        >>> study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        >>> groups = po.optimize(study, model, train, n_trials=8)
        >>> len(study.trials), len(groups), study.trials[0].state.name
        (8, 1, 'COMPLETE')
    """
    where = "phalanx.integrations.optuna.optimize()"
    batch = n_trials if n_members is None else n_members
    for name, value in (("n_trials", n_trials), ("n_members", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive int; got {value!r}.")
    check_step(step, where)
    if len(study.directions) > 1:
        raise ValueError(
            f"{where}: the study has {len(study.directions)} objectives; optimize() tells each "
            "trial one value (train(group) returns (N,)) and reports intermediate values for "
            "pruning, which Optuna allows for single-objective studies only. Create the study "
            "with one direction, or combine the objectives into one value in train()."
        )
    with (
        progress_bar(progress, total=n_trials, desc="optuna trials", unit="trial") as bar,
        recording(step) as steps,
    ):
        return _optimize(
            study, model, train, n_trials, batch, group_by, seed, stack_kwargs, bar, steps
        )


def _optimize(
    study: optuna.Study,
    model: Callable[[Trial], nn.Module],
    train: Callable[[TrialGroup], Any],
    n_trials: int,
    batch: int,
    group_by: Sequence[str],
    seed: int,
    stack_kwargs: dict[str, Any] | None,
    bar: Any,
    steps: Any,
) -> list[TrialGroup]:
    where = "phalanx.integrations.optuna.optimize()"
    done: list[TrialGroup] = []
    left = n_trials
    _stop_requested(study, reset=True)
    while left > 0 and not _stop_requested(study):
        trials, nets = [], []
        for _ in range(min(batch, left)):
            trial = study.ask()
            trials.append(trial)
            try:
                nets.append(build_model(model, trial, seed))
            except Exception:
                for t in trials:
                    _tell(study, t, state=TrialState.FAIL)
                raise
        left -= len(trials)
        _known_names(study, trials, group_by, where)
        groups = _group(trials, nets, group_by)
        _announce_split(groups, group_by, where)
        for k, (gtrials, gnets) in enumerate(groups):
            try:
                stack = build_stack(gnets, **(stack_kwargs or {}))
                group = TrialGroup(gtrials, stack, seed, step=steps.step)
                finals = _values(train(group), len(group), f"{where}: train(group)'s result")
            except Exception:
                # The trials asked and not yet told (this group's, the batch's later groups')
                # would stay RUNNING in the storage: tell them FAIL.
                for t in (t for g, _ in groups[k:] for t in g):
                    _tell(study, t, state=TrialState.FAIL)
                raise
            group._tell(study, finals)
            done.append(group)
            chosen = steps.summary()
            postfix = {"stacks": len(done), **({"step": chosen} if chosen else {})}
            bar.set_postfix(postfix, refresh=False)
            bar.update(len(group))
    return done


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
