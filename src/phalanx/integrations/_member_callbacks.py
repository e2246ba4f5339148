"""The Trainer's per-member pieces: early stopping per member and compute_metrics per member."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor
from transformers.trainer_callback import ExportableState, TrainerCallback
from transformers.trainer_utils import EvalPrediction

__all__ = ["MemberEarlyStopping", "per_member_metrics", "tree_map"]


class MemberEarlyStopping(TrainerCallback, ExportableState):
    """Early stopping per member: member i stops when its own metric has not improved for
    ``patience`` evaluations; training ends when every member has stopped.

    A stopped member keeps its weights and optimizer state (the phalanx optimizer's step
    mask), the others train on. Its state is saved in Trainer checkpoints and restored on
    resume.

    Args:
        patience: evaluations without improvement before a member stops.
        metric: the evaluation metric, read per member as ``f"{metric}/member_{i}"``.
        greater_is_better: whether a larger metric is better (accuracy) or a smaller one
            (loss, the default).
        threshold: the least change that counts as an improvement.

    Attributes:
        stopped: one bool per member (a list).
    """

    def __init__(
        self,
        patience: int = 1,
        metric: str = "eval_loss",
        greater_is_better: bool = False,
        threshold: float = 0.0,
    ) -> None:
        self.patience = patience
        self.metric = metric
        self.greater_is_better = greater_is_better
        self.threshold = threshold
        self.best: list[float | None] = []
        self.wait: list[int] = []
        self.stopped: list[bool] = []

    def mask(self, n: int) -> Tensor:
        """(N,) bool: the members still training."""
        return (
            ~torch.tensor(self.stopped, dtype=torch.bool)
            if self.stopped
            else torch.ones(n, dtype=torch.bool)
        )

    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
    ) -> None:
        metric = self.metric if self.metric.startswith("eval_") else f"eval_{self.metric}"
        keys = sorted(
            (k for k in (metrics or {}) if k.startswith(f"{metric}/member_")),
            key=lambda k: int(k.rsplit("_", 1)[1]),
        )
        if not keys:
            raise ValueError(
                f"phalanx.integrations.transformers.MemberEarlyStopping: the evaluation logged no "
                f"{metric!r} per member ('{metric}/member_0', ...); it logged "
                f"{sorted(metrics or {})}. Name a metric the trainer logs, e.g. 'eval_loss', "
                f"or a key compute_metrics returns."
            )
        n = len(keys)
        if not self.stopped:
            self.best, self.wait, self.stopped = [None] * n, [0] * n, [False] * n
        for i, key in enumerate(keys):
            if self.stopped[i]:
                continue
            value = float(metrics[key])
            best = self.best[i]
            better = best is None or (
                value > best + self.threshold
                if self.greater_is_better
                else value < best - self.threshold
            )
            if better:
                self.best[i], self.wait[i] = value, 0
            else:
                self.wait[i] += 1
                self.stopped[i] = self.wait[i] >= self.patience
        if all(self.stopped):
            control.should_training_stop = True

    def state(self) -> dict[str, Any]:
        """What a Trainer checkpoint saves of this callback (transformers' ``ExportableState``).

        Returns:
            ``{"args": ..., "attributes": ...}``: the constructor's arguments, and each
            member's best metric, evaluations without improvement and whether it stopped;
            ``MemberEarlyStopping.from_state`` rebuilds the callback from it on resume.
        """
        return {
            "args": {
                "patience": self.patience,
                "metric": self.metric,
                "greater_is_better": self.greater_is_better,
                "threshold": self.threshold,
            },
            "attributes": {"best": self.best, "wait": self.wait, "stopped": self.stopped},
        }


def tree_map(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, tuple | list):
        return type(value)(tree_map(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: tree_map(fn, v) for k, v in value.items()}
    return fn(value)


def per_member_metrics(
    compute_metrics: Callable[[EvalPrediction], dict[str, float]], n: int
) -> Callable[[EvalPrediction], dict[str, float]]:
    """``compute_metrics`` called on each member's predictions, keys ``{name}/member_i``."""

    def per_member(prediction: EvalPrediction) -> dict[str, float]:
        out: dict[str, float] = {}
        for i in range(n):

            def pick(a: Any, i: int = i) -> Any:
                return (
                    a[:, i]
                    if isinstance(a, np.ndarray | Tensor) and a.ndim > 1 and a.shape[1] == n
                    else a
                )

            own = EvalPrediction(
                predictions=tree_map(pick, prediction.predictions),
                label_ids=prediction.label_ids,
                inputs=prediction.inputs,
            )
            for key, value in compute_metrics(own).items():
                out[f"{key}/member_{i}"] = value
        return out

    return per_member
