"""Pictures of a population: each member's hyperparameter schedule, the metric, the exploits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["lineage", "plot_population"]


def lineage(log: Sequence[Mapping[str, Any]], member: int) -> list[tuple[int, int]]:
    """Where member ``member``'s weights came from: (step, slot) pairs, oldest first.

    Slot k held the lineage from that step on (until the next pair): following the PBT log
    backwards, each exploit into the lineage's slot hands it over to the source's slot.

    Example:
        >>> log = [  # PBT.log: at step 40 member 3 copied member 12, at 120 member 7 copied 3
        ...     {"step": 40, "member": 3, "source": 12},
        ...     {"step": 120, "member": 7, "source": 3},
        ... ]
        >>> lineage(log, 7)
        [(0, 12), (40, 3), (120, 7)]
    """
    out, current, until = [], member, float("inf")
    for event in reversed(log):
        if event["member"] == current and event["step"] < until:
            out.append((int(event["step"]), current))
            current, until = int(event["source"]), event["step"]
    out.append((0, current))
    return out[::-1]


def _owner(line: list[tuple[int, int]], step: int, *, strictly_before: bool = False) -> int:
    """The slot that held the lineage at ``step`` (just before an exploit at it, if asked)."""
    slot = line[0][1]
    for start, k in line:
        if start < step or (start == step and not strictly_before):
            slot = k
    return slot


def plot_population(
    history: Sequence[Mapping[str, Any]],
    log: Sequence[Mapping[str, Any]] = (),
    *,
    path: str | None = None,
    title: str = "population-based training",
) -> Figure:
    """One panel per hyperparameter (each member's schedule) and one of the metric.

    Members are coloured by their final metric (bright: best); the final best member is
    drawn thick and black along its lineage (``lineage``): the schedule its weights actually
    trained with, switching to a source's history before each exploit. In the metric panel
    each exploit is a red segment from the copied member's metric to its source's, at the
    step it happened.

    Args:
        history: ``PBT.history`` (or the "history" of a saved ``PBT.state_dict()``).
        log: ``PBT.log``, to mark exploits.
        path: write a PNG there too.
        title: the figure's title.

    Returns:
        The matplotlib Figure.

    Example:
        >>> X, Y = torch.randn(64, 4), torch.randn(64, 1)
        >>> stack = phalanx.stack(lambda: nn.Linear(4, 1), num_members=8)
        >>> opt = phalanx.optim.SGD(stack.parameters(), lr=torch.logspace(-3, 0, 8))
        >>> pbt = phalanx.population.PBT(
        ...     stack, opt, {"lr": phalanx.population.LogUniform(1e-3, 1.0)}, interval=10,
        ...     mode="min")
        >>> for step in range(1, 41):
        ...     opt.zero_grad()
        ...     phalanx.member_losses(F.mse_loss, stack(X), Y).sum().backward()
        ...     opt.step()
        ...     if pbt.ready(step):
        ...         _ = pbt.exploit(phalanx.metrics.loss(F.mse_loss, stack(X), Y), step=step)
        >>> fig = phalanx.population.plot_population(pbt.history, pbt.log, path="pbt.png")
        >>> len(fig.axes)  # the learning rate's panel and the metric's
        2
    """
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    steps = [int(h["step"]) for h in history]
    names = list(history[0]["hyperparameters"])
    rounds = [h for h in history if h["metric"] is not None]
    n = len(history[0]["hyperparameters"][names[0]])
    final = rounds[-1]["metric"] if rounds else [0.0] * n
    order = sorted(range(n), key=lambda i: _key(final[i]))  # worst first, drawn underneath
    best = order[-1]
    cmap = colormaps["viridis"]
    line = lineage(log, best)

    fig = Figure(figsize=(9, 3.2 * (len(names) + 1)), layout="constrained")
    axes = fig.subplots(len(names) + 1, 1, sharex=True, squeeze=False)[:, 0]
    end = steps[-1] + max(1, steps[-1] - steps[-2]) if len(steps) > 1 else 1
    for ax, name in zip(axes, names):
        for rank, i in enumerate(order):
            values = [h["hyperparameters"][name][i] for h in history]
            ax.step(
                [*steps, end], [*values, values[-1]], where="post",
                color=cmap(rank / max(n - 1, 1)), lw=0.8, alpha=0.6,
            )  # fmt: skip
        values = [h["hyperparameters"][name][_owner(line, h["step"])] for h in history]
        ax.step([*steps, end], [*values, values[-1]], where="post", color="black", lw=2.2)
        flat = [v for h in history for v in h["hyperparameters"][name]]
        if min(flat) > 0 and max(flat) > 10 * min(flat):
            ax.set_yscale("log")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    axes[0].set_title(f"{title}: each member's schedule (black: the best member's lineage)")

    ax = axes[-1]
    if rounds:
        x = [int(h["step"]) for h in rounds]
        for rank, i in enumerate(order):
            ax.plot(
                x, [h["metric"][i] for h in rounds], color=cmap(rank / max(n - 1, 1)),
                lw=0.7, alpha=0.5, marker=".", ms=3,
            )  # fmt: skip
        best_line = [h["metric"][_owner(line, h["step"], strictly_before=True)] for h in rounds]
        ax.plot(x, best_line, color="black", lw=2.2)
    for k, event in enumerate(log):
        ax.plot(
            [event["step"]] * 2, [event["metric"], event["source_metric"]], color="red",
            lw=0.8, alpha=0.5, label="exploit: copied member -> its source" if k == 0 else None,
        )  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("metric")
    ax.set_title("each member's metric at each ready step")
    ax.grid(True, alpha=0.3)
    if log:
        ax.legend(loc="lower right", fontsize=9)
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _key(value: float | None) -> float:
    """Sort key of a metric: NaN and None first (worst)."""
    return float("-inf") if value is None or value != value else float(value)
