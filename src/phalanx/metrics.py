"""Per-member metrics: (N,) losses and accuracies, a text table, a plot; and the ensemble's
own: predictive mean, its NLL and calibration error, disagreement, mutual information.

Example:
    >>> logits = torch.randn(4, 32, 10)  # (N, B, C)
    >>> y = torch.randint(0, 10, (32,))  # shared targets (B,), or (N, B) per member
    >>> acc = phalanx.metrics.accuracy(logits, y)  # (N,)
    >>> losses = phalanx.metrics.loss(F.cross_entropy, logits, y)  # (N,)
    >>> columns = {"accuracy": acc, "loss": losses}
    >>> print(phalanx.metrics.table(columns, sort_by="loss", descending=False))  # best first
    member  accuracy   loss
         0     0.125  2.598
         2   0.09375   2.65
         3     0.125  3.056
         1   0.09375  3.117
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from phalanx._warnings import PhalanxDeprecationWarning, warn
from phalanx.train._ensemble_metrics import (
    disagreement,
    ece,
    mutual_information,
    nll,
    predictive_mean,
)
from phalanx.train._losses import member_losses

__all__ = [
    "accuracy",
    "disagreement",
    "ece",
    "loss",
    "mutual_information",
    "nll",
    "plot",
    "predictive_mean",
    "table",
]


def _shared(fn: str, in_dims: tuple[int | None, int | None] | None, shared: bool | None) -> Any:
    """The target's member dim from ``in_dims`` (or the deprecated ``shared``); None: infer."""
    if shared is not None:
        warn(
            f"{fn}: shared= is deprecated; pass in_dims=(0, None) for a shared target or "
            f"in_dims=(0, 0) for per-member targets, as phalanx.member_losses takes it.",
            PhalanxDeprecationWarning,
        )
        if in_dims is None:
            return bool(shared)
    if in_dims is None:
        return None
    if tuple(in_dims) not in {(0, None), (0, 0)}:
        raise ValueError(
            f"{fn}: in_dims must be (0, None) (targets shared by every member) or (0, 0) "
            f"(per-member targets); got {in_dims!r}."
        )
    return in_dims[1] is None


def _targets(fn: str, outputs: Tensor, targets: Tensor, shared: bool | None) -> Tensor:
    """Targets as (N, B, ...): shared targets (B, ...) are expanded over the members."""
    if not isinstance(outputs, Tensor) or not isinstance(targets, Tensor):
        raise TypeError(
            f"{fn}: outputs and targets must be tensors; got {type(outputs).__name__} and "
            f"{type(targets).__name__}."
        )
    if outputs.dim() < 2:
        raise ValueError(
            f"{fn}: outputs have shape {tuple(outputs.shape)}; expected (N, B, ...), members "
            "first, as a stack returns them."
        )
    n, b = outputs.shape[:2]
    if shared is None:
        shared = tuple(targets.shape[:2]) != (n, b)
    if shared:
        if targets.dim() < 1 or targets.shape[0] != b:
            raise ValueError(
                f"{fn}: shared targets must have shape (B, ...) with B = {b}, the batch of the "
                f"outputs {tuple(outputs.shape)}; got {tuple(targets.shape)}. Per-member "
                f"targets have shape ({n}, {b}, ...)."
            )
        return targets.expand(n, *targets.shape)  # a view: no copy
    return targets


def loss(
    loss_fn: Any,
    outputs: Any,
    targets: Any = None,
    *,
    in_dims: tuple[int | None, int | None] | None = None,
    shared: bool | None = None,
) -> Tensor:
    """Each member's loss on its batch, detached: for logging and model selection.

    The value of ``phalanx.member_losses`` (use that one to train: it keeps the graph), with the
    same arguments in the same order.

    Args:
        loss_fn: a loss returning a scalar for one member's batch, e.g. ``F.cross_entropy`` or
            ``F.mse_loss``.
        outputs: (N, B, ...) the stack's outputs, e.g. logits (N, B, C).
        targets: (B, ...) shared by all members, or (N, B, ...) one batch per member.
        in_dims: (0, None) for shared targets, (0, 0) for per-member ones, as
            ``phalanx.member_losses`` takes it; None infers it: per-member if ``targets`` starts
            with (N, B).
        shared: deprecated; use ``in_dims``.

    Returns:
        (N,) each member's loss.

    Example:
        >>> loss(F.cross_entropy, torch.zeros(2, 4, 3), torch.zeros(4, dtype=torch.long))
        tensor([1.0986, 1.0986])
    """
    fn = "phalanx.metrics.loss()"
    if isinstance(loss_fn, Tensor):  # the order before 0.2: loss(outputs, targets, loss_fn)
        warn(
            f"{fn}: the loss function comes first, as in phalanx.member_losses: "
            f"loss(loss_fn, outputs, targets). loss(outputs, targets[, loss_fn]) is deprecated.",
            PhalanxDeprecationWarning,
        )
        loss_fn, outputs, targets = (
            F.cross_entropy if targets is None else targets,
            loss_fn,
            outputs,
        )
    if not callable(loss_fn):
        raise TypeError(f"{fn}: loss_fn must be a callable loss; got {type(loss_fn).__name__}.")
    targets = _targets(fn, outputs, targets, _shared(fn, in_dims, shared))
    with torch.no_grad():
        return member_losses(loss_fn, outputs, targets, in_dims=(0, 0))


def accuracy(
    logits: Tensor,
    targets: Tensor,
    *,
    in_dims: tuple[int | None, int | None] | None = None,
    shared: bool | None = None,
) -> Tensor:
    """The fraction of each member's batch whose arg-max class is the target.

    Args:
        logits: (N, B, C) class scores.
        targets: (B,) class indices shared by all members, or (N, B) per member.
        in_dims: (0, None) for shared targets, (0, 0) for per-member ones; None infers it
            from their shape.
        shared: deprecated; use ``in_dims``.

    Returns:
        (N,) float accuracies in [0, 1].

    Example:
        >>> accuracy(torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]]), torch.tensor([0]))
        tensor([1., 0.])
    """
    fn = "phalanx.metrics.accuracy()"
    if logits.dim() != 3:
        raise ValueError(f"{fn}: logits must have shape (N, B, C); got {tuple(logits.shape)}.")
    targets = _targets(fn, logits, targets, _shared(fn, in_dims, shared))
    return (logits.argmax(dim=-1) == targets).float().mean(dim=1)


def table(
    columns: Mapping[str, Tensor | Sequence[float]],
    *,
    sort_by: str | None = None,
    descending: bool = True,
    top: int | None = None,
    precision: int = 4,
) -> str:
    """A text table with one row per member and one column per (N,) metric.

    Args:
        columns: name -> (N,) values, e.g. {"lr": lrs, "accuracy": acc}.
        sort_by: a column to sort the rows by (NaN last); None keeps member order.
        descending: sort from the largest value.
        top: keep only the first ``top`` rows.
        precision: significant digits.

    Returns:
        The table as a string, a header line then one line per member.

    Example:
        >>> print(table({"accuracy": torch.tensor([0.5, 0.9])}, sort_by="accuracy"))
        member  accuracy
             1       0.9
             0       0.5
    """
    fn = "phalanx.metrics.table()"
    values = {k: torch.as_tensor(v).detach().cpu().double().reshape(-1) for k, v in columns.items()}
    sizes = {k: v.numel() for k, v in values.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"{fn}: every column must have one value per member; got sizes {sizes}.")
    n = next(iter(sizes.values()), 0)
    order = list(range(n))
    if sort_by is not None:
        if sort_by not in values:
            raise ValueError(f"{fn}: sort_by={sort_by!r} is not a column; columns: {list(values)}.")
        key = values[sort_by].tolist()
        sign = -1.0 if descending else 1.0
        order.sort(
            key=lambda i: (math.isnan(key[i]), sign * key[i] if not math.isnan(key[i]) else 0)
        )
    order = order[:top] if top is not None else order
    header = ["member", *values]
    rows = [[str(i)] + [f"{values[k][i].item():.{precision}g}" for k in values] for i in order]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = [
        "  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in [header, *rows]
    ]
    return "\n".join(lines)


def plot(
    values: Tensor,
    path: str | os.PathLike[str],
    *,
    x: Tensor | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    logx: bool = False,
    title: str | None = None,
) -> str:
    """Writes a PNG of a per-member metric; matplotlib is imported only here.

    Args:
        values: (N,) one value per member, drawn as points at ``x`` (default: member index);
            or (T, N) one curve per member over T steps, coloured by ``x`` when given.
        path: the image file to write.
        x: (N,) a per-member quantity such as the learning rate.
        xlabel, ylabel, title: axis labels and title.
        logx: log-scale the x axis (points), or the colour scale (curves).

    Returns:
        The path written.

    Example:
        >>> lrs = torch.logspace(-4, 0, 8)  # (N,) one learning rate per member
        >>> accuracy = torch.rand(8)  # (N,) e.g. phalanx.metrics.accuracy(stack(x), y)
        >>> plot(accuracy, "sweep.png", x=lrs, xlabel="learning rate", logx=True)
        'sweep.png'
    """
    try:
        from matplotlib import cm, colormaps, colors
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "phalanx.metrics.plot(): needs matplotlib; install it with "
            "`pip install 'phalanx[plot]'`."
        ) from error
    v = torch.as_tensor(values).detach().cpu().double()
    xs = None if x is None else torch.as_tensor(x).detach().cpu().double().reshape(-1)
    n = v.shape[-1] if v.dim() else 0
    if v.dim() not in (1, 2) or (xs is not None and xs.numel() != n):
        raise ValueError(
            f"phalanx.metrics.plot(): values must be (N,) or (T, N) and x (N,); got values "
            f"{tuple(v.shape)} and x {None if xs is None else tuple(xs.shape)}."
        )
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax: Any = fig.add_subplot()
    if v.dim() == 1:
        ax.scatter((xs if xs is not None else torch.arange(n)).numpy(), v.numpy(), s=16)
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel or ("member" if xs is None else ""))
    else:
        steps = torch.arange(v.shape[0]).numpy()
        if xs is None:
            for i in range(n):
                ax.plot(steps, v[:, i].numpy(), lw=0.8)
        else:
            lo, hi = float(xs.min()), float(xs.max())
            norm = colors.LogNorm(lo, hi) if logx else colors.Normalize(lo, hi)
            cmap = colormaps["viridis"]
            for i in range(n):
                ax.plot(steps, v[:, i].numpy(), lw=0.8, color=cmap(norm(xs[i].item())))
            fig.colorbar(cm.ScalarMappable(norm, cmap), ax=ax, label=xlabel or "")
        ax.set_xlabel("step")
    ax.set_ylabel(ylabel or "")
    if title:
        ax.set_title(title)
    path = os.fspath(path)
    fig.savefig(path, dpi=120)
    return path


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
