"""``phalanx demo``: a learning-rate sweep of a population of networks on scikit-learn's digits.

The population is a grid of learning rates x seeds, trained as one stack with per-member
learning rates and isolation: members whose loss or gradients overflow are skipped, then
frozen, while the others train as if they were alone. The demo then prints the best members,
the ensemble of the top k, the sweep's wall time against the same sweep run as a loop over
``nn.Module``s with ``torch.optim`` (timed on a few members and extrapolated), compares shared
with per-member minibatches, and writes a plot of accuracy against learning rate.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import phalanx
from phalanx_tools.threads import intra_op_threads

if TYPE_CHECKING:
    from tqdm import tqdm

MOMENTUM = 0.9
CHANCE = 0.1  # ten classes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the demo's options to its subcommand parser."""
    add = parser.add_argument
    add("--members", type=int, default=64, help="networks in the sweep (default 64)")
    add("--seeds", type=int, default=4, help="seeds per learning rate (default 4)")
    add("--lr-min", type=float, default=1e-3, help="smallest learning rate (default 1e-3)")
    add("--lr-max", type=float, default=10.0, help="largest learning rate (default 10)")
    add("--epochs", type=int, default=30, help="passes over the training set (default 30)")
    add("--batch-size", type=int, default=32, help="minibatch size per member (default 32)")
    add("--hidden", type=int, default=64, help="hidden units of each network (default 64)")
    add("--top-k", type=int, default=8, help="members in the ensemble (default 8)")
    add("--loop-members", type=int, default=4, help="members timed as a loop (default 4)")
    add("--freeze-after", type=int, default=3, help="non-finite steps before freezing")
    add("--plot", default="phalanx-demo.png", help="PNG to write (default phalanx-demo.png)")
    add("--seed", type=int, default=0, help="seed of the data split, resamples and inits")
    add("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    add("--backend", default="auto", choices=["auto", "fused", "vmap", "loop"])
    add("--step", default="captured", choices=["captured", "eager"],
        help="train with phalanx.compile_step (default; it keeps the eager step where that "
        "measures faster) or the eager loop body")  # fmt: skip
    add("--compile-backend", default="inductor",
        help="compile_step's backend (default inductor; aot_eager captures without "
        "generating code)")  # fmt: skip
    add("--pbt", action="store_true", help="instead: grid vs PBT vs successive halving")
    add("--pbt-interval", type=int, default=2, help="epochs between PBT exploits (default 2)")
    add("--pbt-plot", default="phalanx-pbt.png", help="PNG of PBT's schedules (with --pbt)")


@dataclass
class Digits:
    """scikit-learn's 8x8 digits as tensors: inputs (n, 64) in [0, 1], labels (n,)."""

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_test: Tensor
    y_test: Tensor


def load_digits(seed: int = 0) -> Digits:
    """The 1,797 digits split 60/15/25 into train, validation and test sets.

    Raises:
        SystemExit: scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise SystemExit(
            "phalanx demo needs scikit-learn for its data set: pip install 'phalanx[demo]'"
        ) from e
    data = sk_load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    val, test = int(0.60 * len(x)), int(0.75 * len(x))
    parts = order[:val], order[val:test], order[test:]
    return Digits(*(t[p] for p in parts for t in (x, y)))


def _mlp(hidden: int, seed: int) -> nn.Module:
    # LeakyReLU rather than ReLU: at huge learning rates ReLU networks die (every unit stuck
    # at zero, loss at chance), while these overflow to inf and NaN, the failure that
    # isolation is for and that deeper networks show at any activation.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, hidden), nn.LeakyReLU(), nn.Linear(hidden, 10))


def _loader(
    data: Digits,
    args: argparse.Namespace,
    num_members: int,
    *,
    first_member: int = 0,
    bootstrap: bool = True,
) -> phalanx.data.MemberLoader:
    """Batches (members, B, ...) of the training set, by default each member's own bootstrap
    resample reshuffled every epoch; member k's batches depend only on `args.seed` and k."""
    return phalanx.data.MemberLoader(
        data.x_train,
        data.y_train,
        num_members=num_members,
        batch_size=args.batch_size,
        bootstrap=bootstrap,
        # Full batches only: one input shape, and a few fresh samples dropped per epoch.
        drop_last=True,
        seed=args.seed,
        first_member=first_member,
    )


def _bar(total: int | None, desc: str) -> tqdm:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)


@dataclass
class Sweep:
    """What the sweep produced: the trained stack, its optimizer and per-member figures."""

    stack: phalanx.Stack
    opt: phalanx.optim.SGD
    lrs: Tensor  # (N,)
    seeds: Tensor  # (N,) int
    train_loss: Tensor  # (N,) mean loss of the last epoch
    seconds: float
    steps: int
    backend: str  # the backend that trained the stack
    step: str  # which training step ran: compile_step's report, or "eager step"


def _sweep(data: Digits, args: argparse.Namespace) -> Sweep:
    """Trains the lr x seed grid as one stack with per-member lr and isolation."""
    n, s = args.members, args.seeds
    lo, hi = math.log10(args.lr_min), math.log10(args.lr_max)
    lrs = torch.logspace(lo, hi, n // s, dtype=torch.float64)
    lrs = lrs.repeat_interleave(s)  # member i: lr index i // s, seed i % s
    seeds = torch.arange(s).repeat(n // s)
    models = [_mlp(args.hidden, args.seed + int(k)) for k in seeds]
    stack = phalanx.stack(models, backend=args.backend)
    opt = phalanx.optim.SGD(
        stack.parameters(),
        lr=lrs,
        momentum=MOMENTUM,
        skip_nonfinite=True,
        freeze_after=args.freeze_after,
    )
    # One resample per seed, shared by that seed's learning rates: lrs are compared on the
    # same data and the same initial weights.
    loader = _loader(data, args, s)
    steps = args.epochs * len(loader)
    train_loss = torch.zeros(n)
    start = time.perf_counter()
    # The step the README teaches: forward, member_losses, backward and the optimizer step
    # captured as one computation (per-member batches: in_dims=0 for inputs and targets).
    step = None
    if args.step == "captured":
        step = phalanx.compile_step(
            stack, F.cross_entropy, opt, in_dims=0, backend=args.compile_backend
        )
    with _bar(steps, "sweep") as bar, warnings.catch_warnings():
        warnings.simplefilter("ignore", phalanx.optim.NonFiniteWarning)  # reported below
        for _ in range(args.epochs):
            total = torch.zeros(n)
            for xb, yb in loader:  # (S, B, 64), (S, B)
                if step is not None:
                    losses = step(xb[seeds], yb[seeds])  # (N, B, 64) -> (N,) losses
                else:
                    out = stack(xb[seeds], in_dims=0)  # (N, B, 64) -> (N, B, 10)
                    losses = phalanx.member_losses(F.cross_entropy, out, yb[seeds], in_dims=(0, 0))
                    opt.zero_grad()
                    losses.sum().backward()
                    opt.step(loss=losses)
                total += losses.detach()
                bar.update()
            train_loss = total / len(loader)
            finite = train_loss[train_loss.isfinite()]
            best = f"{finite.min():.2g}" if len(finite) else "-"
            bar.set_postfix(frozen=int(opt.frozen.sum()), best_loss=best)
    seconds = time.perf_counter() - start
    used = "eager step (--step eager)" if step is None else f"compile_step, {step.report}"
    return Sweep(stack, opt, lrs, seeds, train_loss, seconds, steps, stack.backend, used)


def _loop(
    data: Digits, args: argparse.Namespace, sweep: Sweep, members: list[int]
) -> tuple[float, list[nn.Module]]:
    """The same training for `members`, one plain nn.Module and torch.optim.SGD at a time."""
    models = [_mlp(args.hidden, args.seed + int(sweep.seeds[i])) for i in members]
    start = time.perf_counter()
    with _bar(len(members) * sweep.steps, f"loop, {len(members)} members") as bar:
        for i, model in zip(members, models, strict=True):
            opt = torch.optim.SGD(model.parameters(), lr=float(sweep.lrs[i]), momentum=MOMENTUM)
            loader = _loader(data, args, 1, first_member=int(sweep.seeds[i]))
            for _ in range(args.epochs):
                for xb, yb in loader:  # (1, B, 64), (1, B)
                    loss = F.cross_entropy(model(xb[0]), yb[0])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    bar.update()
    return time.perf_counter() - start, models


def _shared_vs_own(data: Digits, args: argparse.Namespace, lr: float, k: int) -> list[str]:
    """Issue 2's two ways to feed an ensemble: (a) one shared stream, (b) one per member."""
    lines = []
    for own in (False, True):
        models = [_mlp(args.hidden, args.seed + 100 + j) for j in range(k)]
        stack = phalanx.stack(models, backend=args.backend)
        opt = phalanx.optim.SGD(stack.parameters(), lr=lr, momentum=MOMENTUM)
        loader = _loader(data, args, k if own else 1, bootstrap=own)
        start = time.perf_counter()
        label = "(b) own bootstrap batches" if own else "(a) one shared batch stream"
        with _bar(args.epochs * len(loader), label) as bar:
            for _ in range(args.epochs):
                for xb, yb in loader:
                    if own:  # xb (k, B, 64): member j sees xb[j]
                        out = stack(xb, in_dims=0)
                        losses = phalanx.member_losses(F.cross_entropy, out, yb, in_dims=(0, 0))
                    else:  # xb[0] (B, 64): every member sees it
                        out = stack(xb[0])
                        losses = phalanx.member_losses(F.cross_entropy, out, yb[0])
                    opt.zero_grad()
                    losses.sum().backward()
                    opt.step()
                    bar.update()
        seconds = time.perf_counter() - start
        with torch.no_grad():
            logits = stack(data.x_test)  # (k, n_test, 10)
        member = phalanx.metrics.accuracy(logits, data.y_test).mean()
        ensemble = _ensemble_accuracy(logits, data.y_test)
        lines.append(
            f"  {label + ':':28} mean member {member:.3f}, ensemble {ensemble:.3f} "
            f"({seconds:.1f} s)"
        )
    return lines


def _ensemble_accuracy(logits: Tensor, y: Tensor) -> float:
    """Accuracy of the mean of the members' softmax; logits (k, n, 10)."""
    return float((logits.softmax(-1).mean(0).argmax(-1) == y).float().mean())


def _plot(path: str, sweep: Sweep, test_acc: Tensor, ensemble: float, k: int, title: str) -> str:
    """Test accuracy against learning rate: one marker per seed, diverged members as red x."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    lrs, seeds, frozen = sweep.lrs.numpy(), sweep.seeds, sweep.opt.frozen.cpu()
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    markers = "osD^vP*X"
    for s in range(int(seeds.max()) + 1):
        ok = (seeds == s) & ~frozen
        ax.scatter(
            lrs[ok.numpy()], test_acc[ok].numpy(), marker=markers[s % len(markers)], s=36,
            facecolors="none", edgecolors=f"C{s % 10}", linewidths=1.2, label=f"seed {s}",
        )  # fmt: skip
    if frozen.any():
        ax.scatter(
            lrs[frozen.numpy()], test_acc[frozen].numpy(), marker="x", s=60, color="red",
            linewidths=1.8, label="diverged (non-finite): frozen",
        )  # fmt: skip
    grid = sweep.lrs.view(-1, int(seeds.max()) + 1)[:, 0].numpy()
    finite = torch.where(frozen, float("nan"), test_acc).view(len(grid), -1)
    mean = finite.nanmean(1).numpy()  # NaN, so no line, where every seed diverged
    ax.plot(grid, mean, color="0.5", lw=1, zorder=0, label="mean over finite seeds")
    if k:
        ax.axhline(ensemble, color="C2", ls="--", lw=1)
        label = f"top-{k} ensemble {ensemble:.3f}"
        ax.text(grid[0], ensemble + 0.01, label, color="C2", va="bottom")
    ax.axhline(CHANCE, color="0.3", ls=":", lw=1)
    ax.text(grid[0], CHANCE + 0.01, "chance", color="0.3", va="bottom")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("learning rate (SGD, momentum 0.9)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if k:
        handles.append(Line2D([], [], color="C2", ls="--"))
        labels.append(f"ensemble of the top {k}")
    ax.legend(handles, labels, loc="center left", fontsize=9)
    fig.savefig(path, dpi=110)
    return path


def _check(args: argparse.Namespace) -> str | None:
    """A usage error in the options, or None."""
    names = ("members", "seeds", "epochs", "batch_size", "hidden", "top_k", "freeze_after")
    names += ("pbt_interval",)  # type: ignore[assignment]
    for name in (*names, "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}."
    if args.members % args.seeds:
        return (
            f"--members {args.members} must be a multiple of --seeds {args.seeds}: the members "
            f"are a grid of learning rates x seeds (e.g. --members {args.seeds * 16})."
        )
    if not 0 < args.lr_min <= args.lr_max:
        return f"need 0 < --lr-min <= --lr-max; got {args.lr_min} and {args.lr_max}."
    if not 0 <= args.loop_members <= args.members:
        return f"--loop-members must be in [0, --members]; got {args.loop_members}."
    return None


def _report_sweep(
    sweep: Sweep, data: Digits, args: argparse.Namespace
) -> tuple[Tensor, Tensor, float]:
    """Prints the best members, the diverged ones and the top-k ensemble.

    Returns:
        (N,) test accuracies, the indices of the top k members, the top k's ensemble accuracy.
    """
    stack, frozen, n = sweep.stack, sweep.opt.frozen.cpu(), args.members
    with torch.no_grad():
        val_acc = phalanx.metrics.accuracy(stack(data.x_val), data.y_val)  # (N,)
        test_logits = stack(data.x_test)  # (N, n_test, 10)
    test_acc = phalanx.metrics.accuracy(test_logits, data.y_test)

    # Select on validation accuracy, report on the test set; diverged members never count.
    k = min(args.top_k, n - int(frozen.sum()))
    selectable = torch.where(frozen, float("nan"), val_acc)
    best = torch.argsort(selectable.nan_to_num(-1.0), descending=True, stable=True)[:k]
    columns = {"lr": sweep.lrs, "seed": sweep.seeds, "train loss": sweep.train_loss}
    columns |= {"val acc": selectable, "test acc": test_acc}
    if k:
        print(f"\nBest {k} of {n} members by validation accuracy:")
        _print_table(phalanx.metrics.table(columns, sort_by="val acc", top=k))
    else:
        print(f"\nEvery member diverged: lower --lr-max (now {args.lr_max:g}).")

    n_frozen = int(frozen.sum())
    if n_frozen:
        print(
            f"\nDiverged: {n_frozen} of {n} members had non-finite losses or gradients and "
            f"were frozen (lr {float(sweep.lrs[frozen].min()):.3g} and up); the other "
            f"{n - n_frozen} trained on as if they were alone."
        )
    else:
        print(f"\nDiverged: none of the {n} members had a non-finite loss or gradient.")
    dead = ~frozen & (val_acc < 2 * CHANCE)
    if dead.any():
        print(f"  {int(dead.sum())} more stayed finite but did not learn (val acc < {2 * CHANCE}).")
    ensemble = _ensemble_accuracy(test_logits[best], data.y_test) if k else float("nan")
    if k:
        print(
            f"Ensemble of the top {k} (mean of softmax): test accuracy {ensemble:.3f}; "
            f"best single member {float(test_acc[best[0]]):.3f}."
        )
    return test_acc, best, ensemble


def _report_time(sweep: Sweep, data: Digits, args: argparse.Namespace, test_acc: Tensor) -> None:
    """Times the loop on a few members, extrapolates, and checks them against the stack."""
    n = args.members
    threads = torch.get_num_threads()
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(
        f"\nWall time of the sweep, {n} members x {sweep.steps} steps "
        f"({threads} thread{'s' * (threads != 1)}{load}):\n"
        f"  phalanx, one stack (backend {sweep.backend!r}):  {sweep.seconds:6.1f} s\n"
        f"    training step: {sweep.step}"
    )
    if not args.loop_members:
        return
    picks = torch.linspace(0, n - 1, args.loop_members).round().long().unique().tolist()
    seconds, models = _loop(data, args, sweep, picks)
    estimate = seconds / len(picks) * n
    print(
        f"  loop over nn.Modules, torch.optim.SGD: {estimate:6.1f} s  EXTRAPOLATED from "
        f"{len(picks)} member{'s' * (len(picks) > 1)} timed ({seconds:.1f} s) x "
        f"{n / len(picks):g}\n"
        f"  speed-up of phalanx over the loop (extrapolated): {estimate / sweep.seconds:.1f}x"
    )
    twins = phalanx.export_members(sweep.stack, picks)
    loop_acc, differences = [], []
    for model, twin in zip(models, twins, strict=True):
        with torch.no_grad():
            loop_acc.append(phalanx.metrics.accuracy(model(data.x_test)[None], data.y_test))
        weights = model.state_dict()
        differences.append(max((weights[name] - w).abs().max() for name, w in twin.items()))
    print("  the timed loop members against their twins in the stack:")
    print("    member      lr  seed  loop test acc  stack test acc  max |weight diff|")
    for j, i in enumerate(picks):
        print(
            f"    {i:6d}  {float(sweep.lrs[i]):6.3g}  {int(sweep.seeds[i]):4d}  "
            f"{float(loop_acc[j]):13.3f}  {float(test_acc[i]):14.3f}  {float(differences[j]):17.2g}"
        )
    print("    (batched and per-member kernels round differently; large learning rates amplify it)")
    if any(d.isnan() for d in differences):
        print("    (nan: the loop's member went NaN; the stack froze its twin at finite weights)")


def _print_table(table: str, indent: int = 2) -> None:
    print("\n".join(" " * indent + line for line in table.splitlines()))


def run(args: argparse.Namespace) -> int:
    """Runs the sweep and prints its report.

    Returns:
        0 on success, 2 on a usage error.
    """
    problem = _check(args)
    if problem:
        print(f"phalanx demo: {problem}", file=sys.stderr)
        return 2
    data = load_digits(args.seed)
    if args.pbt:
        from phalanx_tools.demo_population import run_population

        with intra_op_threads(args.threads):
            return run_population(data, args)
    n, s = args.members, args.seeds
    print(
        f"phalanx demo: a learning-rate sweep of {n} networks 64-{args.hidden}-10 "
        f"(Linear, LeakyReLU, Linear) on scikit-learn's digits\n"
        f"  {len(data.x_train)} train / {len(data.x_val)} validation / {len(data.x_test)} test "
        f"images; {n // s} learning rates log-spaced {args.lr_min:g} .. {args.lr_max:g} "
        f"x {s} seeds\n"
        f"  phalanx.optim.SGD (momentum {MOMENTUM}), {args.epochs} "
        f"epoch{'s' * (args.epochs != 1)} of batch {args.batch_size}; each seed its own "
        "bootstrap resample and initial weights\n"
        f"  isolation on: a member with a non-finite loss or gradient skips that step, and is "
        f"frozen after {args.freeze_after} such steps",
        flush=True,
    )
    with intra_op_threads(args.threads):
        sweep = _sweep(data, args)
        test_acc, best, ensemble = _report_sweep(sweep, data, args)
        _report_time(sweep, data, args, test_acc)
        k = len(best)
        if k:
            lr = float(sweep.lrs[best[0]])
            print(f"\nShared vs per-member minibatches: {k} new members at the best lr, {lr:.3g}")
            print("\n".join(_shared_vs_own(data, args, lr, k)))
    if args.plot:
        title = f"phalanx demo: {n} networks on digits, {args.epochs} epochs"
        _plot(args.plot, sweep, test_acc, ensemble, k, title)
        print(f"\nPlot of test accuracy against learning rate: {os.path.abspath(args.plot)}")
    return 0
