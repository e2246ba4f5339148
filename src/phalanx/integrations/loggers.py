"""One run per member in TensorBoard, Weights & Biases and MLflow, each through its own API.

A stack's metrics are (N,) tensors; a tracking tool wants one run per trial. Each logger here
opens N runs (one per member, with that member's hyperparameters) and fans an (N,) tensor out
to them with one host transfer per call:

- :class:`TensorBoardMembers`: one ``SummaryWriter`` per member (``log_dir/member_03``), its
  hyperparameters and final metrics written with ``add_hparams`` at :meth:`close`.
- :class:`WandbMembers`: N ``wandb.init(reinit="create_new")`` runs in one ``group``, each
  with its member's ``config``; offline (``mode="offline"``) unless told otherwise.
- :class:`MLflowMembers`: a parent run and N child runs (tag ``mlflow.parentRunId``) through
  ``MlflowClient``; metrics are kept and sent with ``log_batch``, one call per member every
  ``flush_every`` steps (an MLflow call costs about as much for one metric as for many).

Each tool is imported when its logger is built, so a missing tool fails there with the
``pip install`` line. All take hyperparameters as a mapping of name to one value shared by
all members or N values (a list or an (N,) tensor), e.g. ``optimizer.hyperparameters()``.

Example:
    >>> from phalanx.integrations.loggers import TensorBoardMembers
    >>> import tempfile
    >>> log = TensorBoardMembers(tempfile.mkdtemp(), num_members=4,
    ...                          hparams={"lr": [1e-3, 1e-2, 1e-1, 1.0], "width": 32})
    >>> for step in range(3):
    ...     log.log({"train/loss": torch.rand(4)}, step=step)
    >>> log.close({"hparam/final_loss": torch.rand(4)})
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["MLflowMembers", "TensorBoardMembers", "WandbMembers", "member_rows"]

Values = Tensor | Sequence[float] | float | int | str | bool


def member_rows(values: Mapping[str, Values], num_members: int, where: str) -> list[dict[str, Any]]:
    """N dicts, member i's values: (N,) entries split, single values repeated.

    Tensors move to the host together (one transfer); a (N,) tensor or an N-list gives each
    member its entry, a 0-d tensor or a plain value is every member's.

    Raises:
        ValueError: an entry with neither one nor N values.
    """
    names = list(values)
    tensors = [v for v in values.values() if isinstance(v, Tensor)]
    pieces = [t.detach().reshape(-1).double() for t in tensors]
    host = iter(torch.cat(pieces).cpu().tolist() if pieces else [])
    rows: list[dict[str, Any]] = [{} for _ in range(num_members)]
    for name in names:
        v = values[name]
        if isinstance(v, Tensor):
            flat: list[Any] = [next(host) for _ in range(v.numel())]
            if v.dim() == 0:
                flat = flat * num_members
            elif v.shape != (num_members,):
                raise ValueError(
                    f"{where}: {name!r} has shape {tuple(v.shape)}; expected one value per member "
                    f"({num_members},) or a single value."
                )
            per: list[Any] = flat
        elif isinstance(v, Sequence) and not isinstance(v, str):
            if len(v) != num_members:
                raise ValueError(
                    f"{where}: {name!r} has {len(v)} values; expected {num_members} (one per "
                    f"member) or a single value."
                )
            per = list(v)
        else:
            per = [v] * num_members
        for i in range(num_members):
            rows[i][name] = per[i]
    return rows


def _install(tool: str, package: str) -> ImportError:
    return ImportError(
        f"phalanx.integrations.loggers: {tool} is not installed; pip install {package} "
        f"(or pip install phalanx[loggers])."
    )


class TensorBoardMembers:
    """One TensorBoard run (a ``SummaryWriter``) per member, with its hyperparameters.

    Args:
        log_dir: the parent folder; member i writes to ``log_dir/member_{i:02d}``, so
            TensorBoard lists N runs side by side.
        num_members: N.
        hparams: each member's hyperparameters (one value or N values per name), written by
            ``add_hparams`` at :meth:`close` (TensorBoard's HParams tab).
        **writer_kwargs: passed to every ``SummaryWriter`` (``flush_secs``, ...).

    Attributes:
        writers: the N writers, member i's at index i.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        num_members: int,
        hparams: Mapping[str, Values] | None = None,
        **writer_kwargs: Any,
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _install("TensorBoard", "tensorboard") from e
        self.num_members = num_members
        self.hparams = member_rows(hparams or {}, num_members, "TensorBoardMembers(hparams=)")
        self.writers = [
            SummaryWriter(os.path.join(os.fspath(log_dir), f"member_{i:02d}"), **writer_kwargs)
            for i in range(num_members)
        ]

    def log(self, metrics: Mapping[str, Values], step: int) -> None:
        """Writes each metric's member-i value to member i's run (``add_scalar``).

        Args:
            metrics: name to (N,) tensor (or one value for all members).
            step: the global step.
        """
        rows = member_rows(metrics, self.num_members, "TensorBoardMembers.log()")
        for w, row in zip(self.writers, rows):
            for name, v in row.items():
                w.add_scalar(name, v, step)

    def close(self, final_metrics: Mapping[str, Values] | None = None) -> None:
        """Writes each member's hyperparameters with its ``final_metrics``, then closes."""
        finals = member_rows(final_metrics or {}, self.num_members, "TensorBoardMembers.close()")
        for w, hp, fin in zip(self.writers, self.hparams, finals):
            if hp:
                w.add_hparams(hp, fin, run_name=".")
            w.close()


class WandbMembers:
    """N Weights & Biases runs in one group, one per member, each with its own config.

    Args:
        num_members: N.
        group: the W&B group that gathers the members (e.g. the sweep's name).
        hparams: each member's config (one value or N values per name); the member index is
            added as ``member``.
        mode: "offline" (default: nothing leaves the machine; ``wandb sync`` uploads later),
            "online" or "disabled".
        **init_kwargs: passed to every ``wandb.init`` (``project``, ``dir``, ``tags``, ...).

    Attributes:
        runs: the N runs, member i's at index i.
    """

    def __init__(
        self,
        num_members: int,
        group: str,
        hparams: Mapping[str, Values] | None = None,
        *,
        mode: str = "offline",
        **init_kwargs: Any,
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise _install("Weights & Biases", "wandb") from e
        self.num_members = num_members
        rows = member_rows(hparams or {}, num_members, "WandbMembers(hparams=)")
        self.runs = [
            wandb.init(
                name=f"{group}-member_{i}",
                group=group,
                config={**row, "member": i},
                mode=mode,  # type: ignore[arg-type]
                reinit="create_new",
                **init_kwargs,
            )
            for i, row in enumerate(rows)
        ]

    def log(self, metrics: Mapping[str, Values], step: int) -> None:
        """Logs each metric's member-i value to member i's run (``run.log``)."""
        rows = member_rows(metrics, self.num_members, "WandbMembers.log()")
        for run, row in zip(self.runs, rows):
            run.log(row, step=step)

    def close(self, final_metrics: Mapping[str, Values] | None = None) -> None:
        """Writes ``final_metrics`` into each run's summary, then finishes the runs."""
        finals = member_rows(final_metrics or {}, self.num_members, "WandbMembers.close()")
        for run, fin in zip(self.runs, finals):
            run.summary.update(fin)
            run.finish()


class MLflowMembers:
    """A parent MLflow run per stack and one child run per member, logged in batches.

    Metrics are kept in memory and sent every ``flush_every`` calls of :meth:`log` (and at
    :meth:`flush` / :meth:`close`) with one ``MlflowClient.log_batch`` per member (at most
    1000 metrics a call, MLflow's limit), so N members cost N calls per flush, not per step.

    Args:
        num_members: N.
        experiment: the experiment's name (created if missing).
        hparams: each member's parameters (one value or N values per name), logged on its
            child run; the parent gets ``num_members``.
        tracking_uri: where MLflow stores runs, e.g. ``"file:/path/mlruns"``,
            ``"sqlite:///mlflow.db"``; None: MLflow's default.
        run_name: the parent run's name; children are ``f"{run_name}-member_{i}"``.
        flush_every: steps kept before each send; 1 sends every step.

    Attributes:
        client: the ``MlflowClient``.
        parent_id: the parent run's id.
        run_ids: the N child runs' ids, member i's at index i.
    """

    MAX_BATCH = 1000

    def __init__(
        self,
        num_members: int,
        experiment: str,
        hparams: Mapping[str, Values] | None = None,
        *,
        tracking_uri: str | None = None,
        run_name: str = "stack",
        flush_every: int = 50,
    ) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise _install("MLflow", "mlflow-skinny") from e
        if flush_every < 1:
            raise ValueError(f"MLflowMembers: flush_every must be >= 1, got {flush_every}.")
        self.num_members = num_members
        self.flush_every = flush_every
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        exp = found.experiment_id if found else self.client.create_experiment(experiment)
        parent = self.client.create_run(exp, run_name=run_name)
        self.parent_id = parent.info.run_id
        self.client.log_batch(self.parent_id, params=[Param("num_members", str(num_members))])
        rows = member_rows(hparams or {}, num_members, "MLflowMembers(hparams=)")
        self.run_ids = []
        for i, row in enumerate(rows):
            run = self.client.create_run(
                exp,
                run_name=f"{run_name}-member_{i}",
                tags={"mlflow.parentRunId": self.parent_id, "member": str(i)},
            )
            params = [Param(k, str(v)) for k, v in {**row, "member": i}.items()]
            self.client.log_batch(run.info.run_id, params=params)
            self.run_ids.append(run.info.run_id)
        self._pending: list[list[Any]] = [[] for _ in range(num_members)]
        self._calls = 0
        self._last_step = 0

    def log(self, metrics: Mapping[str, Values], step: int) -> None:
        """Keeps each metric's member-i value for member i's run; sends every ``flush_every``."""
        from mlflow.entities import Metric

        rows = member_rows(metrics, self.num_members, "MLflowMembers.log()")
        ts = int(time.time() * 1000)
        for pending, row in zip(self._pending, rows):
            pending.extend(Metric(k, float(v), ts, step) for k, v in row.items())
        self._calls += 1
        self._last_step = step
        if self._calls % self.flush_every == 0:
            self.flush()

    def flush(self) -> None:
        """Sends the kept metrics: one ``log_batch`` per member (per 1000 metrics)."""
        for run_id, pending in zip(self.run_ids, self._pending):
            for at in range(0, len(pending), self.MAX_BATCH):
                self.client.log_batch(run_id, metrics=pending[at : at + self.MAX_BATCH])
            pending.clear()

    def close(
        self, final_metrics: Mapping[str, Values] | None = None, status: str = "FINISHED"
    ) -> None:
        """Sends what is kept and ``final_metrics`` (at the last step), then ends the runs."""
        if final_metrics:
            self.log(final_metrics, step=self._last_step)
        self.flush()
        for run_id in [*self.run_ids, self.parent_id]:
            self.client.set_terminated(run_id, status=status)


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
