"""Ray Tune: a Tune search algorithm driven ask/tell, each batch of its configurations one stack.

Tune's searchers (``ray.tune.search.Searcher``: OptunaSearch, HyperOptSearch, BayesOptSearch,
...) are plain objects with `suggest(trial_id)` and `on_trial_complete(trial_id, result)`;
they run without Ray's runtime (no ``ray.init``, no cluster). ``optimize(searcher, train, ...)``
asks ``n_members`` configurations at a time, lets ``train(configs)`` train them as one stack and
return one value per configuration, and tells the searcher each result (a non-finite value
is told as an error, ``on_trial_complete(..., error=True)``).

Tune's schedulers (ASHA, HyperBand, PBT) and its ``Trainable`` are not used: they schedule
whole Tune trials, one process each, and cannot stop or copy a member of a stack; inside a
stack, ``phalanx.population`` does what they do (successive halving and PBT by member
masks, ``keep_members`` and ``copy_members``, exactly). docs/SEARCH.md gives the reasons.

``train_step(stack, loss_fn, optimizer)`` built inside ``train`` is the stack's training step,
captured (``phalanx.compile_step``) where that measures faster, as ``optimize``'s ``step=``
says; the progress bar's postfix says which step ran.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ray.tune.search import Searcher
from torch import Tensor

from phalanx.core._stack import Stack
from phalanx.integrations._progress import progress_bar
from phalanx.optim import MemberOptimizer
from phalanx.population import TrainStep
from phalanx.population._step import StepMode, check_step, recording

__all__ = ["optimize", "train_step"]


def train_step(
    stack: Stack,
    loss_fn: Callable[..., Tensor] | None,
    optimizer: MemberOptimizer,
    *,
    step: StepMode | None = None,
    **kwargs: Any,
) -> TrainStep:
    """The training step of a batch's stack, for ``train(configs)``.

    ``losses = step(x, y)`` zeroes the gradients, runs the forward, ``member_losses``,
    backward (clipping with ``max_norm=``) and ``optimizer.step``: captured
    (``phalanx.compile_step``) or eager as ``step`` says.

    Args:
        stack, loss_fn, optimizer: as for :func:`phalanx.compile_step`.
        step: "auto" (the captured step where its own timing keeps it, else the eager
            one), "captured" or "eager"; None (the default) takes ``optimize``'s ``step=``.
        **kwargs: ``compile_step``'s ``in_dims``, ``target_in_dims``, ``kw_in_dims``,
            ``max_norm``, ``norm_type``, ``backend``.
    """
    return TrainStep(stack, loss_fn, optimizer, step=step,
                     where="phalanx.integrations.ray_tune.train_step()", **kwargs)  # fmt: skip


def optimize(
    searcher: Searcher,
    train: Callable[[list[dict[str, Any]]], Any],
    *,
    n_trials: int,
    n_members: int | None = None,
    metric: str | None = None,
    prefix: str = "phalanx",
    progress: bool | None = None,
    step: StepMode = "auto",
) -> list[tuple[str, dict[str, Any], float]]:
    """Runs ``n_trials`` configurations of ``searcher``, ``n_members`` at a time as one stack each.

    Args:
        searcher: a Tune ``Searcher`` with its metric, mode and search space set (its
            constructor's ``space=``, ``metric=``, ``mode=``, or ``set_search_properties``).
        train: ``train(configs)`` trains one member per configuration (e.g. `lr=[c["lr"] for
            c in configs]`) and returns their values, (N,).
        n_trials: configurations to run.
        n_members: configurations asked at once (default: all ``n_trials``).
        metric: the result key the searcher optimizes (default: the searcher's own metric).
        prefix: the Tune trial ids are ``f"{prefix}_{k}"``.
        progress: a progress bar of the configurations run, on standard error (tqdm): None
            (the default) shows it when standard error is a terminal; True or False to choose.
        step: the step ``train_step(...)`` builds inside ``train``: "auto" (the default: the
            captured step where ``compile_step``'s timing keeps it), "captured" or "eager";
            the bar's postfix (``step=captured``) and the ``phalanx`` logger say which ran.

    Returns:
        (trial id, configuration, value) for every configuration run, in order.

    Raises:
        ValueError: ``n_trials`` or ``n_members`` not a positive int, the searcher has no metric
            or another one than ``metric=``, or ``train`` did not return one value per
            configuration.
        RuntimeError: the searcher gave no configuration (its search space is not set, or a
            ``ConcurrencyLimiter`` smaller than ``n_members`` wraps it).

    Example:
        >>> from ray import tune
        >>> from ray.tune.search.optuna import OptunaSearch
        >>> import optuna
        >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
        >>> space = OptunaSearch.convert_search_space({"lr": tune.loguniform(1e-3, 1.0)})
        >>> searcher = OptunaSearch(space, metric="loss", mode="min", seed=0)
        >>> runs = optimize(searcher, lambda configs: [c["lr"] for c in configs], n_trials=8)
        >>> len(runs), min(v for _, _, v in runs) == min(c["lr"] for _, c, _ in runs)
        (8, True)
    """
    where = "phalanx.integrations.ray_tune.optimize()"
    batch = n_trials if n_members is None else n_members
    for name, count in (("n_trials", n_trials), ("n_members", batch)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{where}: {name} must be a positive int; got {count!r}.")
    check_step(step, where)
    own = getattr(searcher, "metric", None)
    if metric and own and metric != own:
        raise ValueError(
            f"{where}: metric={metric!r} but the searcher optimizes {own!r}; it would be told "
            f"results without its metric. Pass metric={own!r} (or leave it out), or build the "
            f"searcher with metric={metric!r}."
        )
    metric = metric or own
    if not metric:
        raise ValueError(
            f"{where}: the searcher has no metric; build it with metric= and mode=, or pass "
            "metric= here."
        )
    with (
        progress_bar(progress, total=n_trials, desc="tune trials", unit="trial") as bar,
        recording(step) as steps,
    ):
        return _optimize(searcher, train, n_trials, batch, metric, prefix, bar, steps)


def _optimize(
    searcher: Searcher,
    train: Callable[[list[dict[str, Any]]], Any],
    n_trials: int,
    batch: int,
    metric: str,
    prefix: str,
    bar: Any,
    steps: Any,
) -> list[tuple[str, dict[str, Any], float]]:
    where = "phalanx.integrations.ray_tune.optimize()"
    runs: list[tuple[str, dict[str, Any], float]] = []
    while len(runs) < n_trials:
        ids: list[str] = []
        configs: list[dict[str, Any]] = []
        for _ in range(min(batch, n_trials - len(runs))):
            trial_id = f"{prefix}_{len(runs) + len(ids)}"
            config = searcher.suggest(trial_id)
            if config is None or config == Searcher.FINISHED:
                break
            ids.append(trial_id)
            configs.append(config)
        if not configs:
            raise RuntimeError(
                f"{where}: the searcher gave no configuration after {len(runs)} trials; set "
                "its search space (space=, or set_search_properties) and let it run "
                f"{batch} trials at once (a ConcurrencyLimiter must allow n_members)."
            )
        result = train(configs)
        values = [float(v) for v in (result.tolist() if hasattr(result, "tolist") else result)]
        if len(values) != len(configs):
            raise ValueError(
                f"{where}: train(configs) returned {len(values)} values for {len(configs)} "
                "configurations; return one value per configuration, in order."
            )
        for tid, config, value in zip(ids, configs, values):
            if math.isfinite(value):
                searcher.on_trial_complete(tid, {metric: value})
            else:
                searcher.on_trial_complete(tid, None, error=True)
            runs.append((tid, config, value))
        chosen = steps.summary()
        if chosen:
            bar.set_postfix(step=chosen, refresh=False)
        bar.update(len(configs))
    return runs


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
