"""``phalanx demo --pbt``: the grid sweep against PBT and successive halving at equal compute.

The three runs start from the same population: the demo's grid of learning rates x seeds,
the same initial weights, each member reading its seed's bootstrap resample. They spend the
same number of member-steps (one member taking one SGD step):

- grid: every member trains with its own fixed learning rate for the whole run;
- PBT: every `--pbt-interval` epochs the worst quarter (by validation accuracy) becomes a
  copy of a random member of the best quarter, with its learning rate perturbed (x1.2 or
  x0.8) or, one time in four, redrawn log-uniformly;
- successive halving: the worse half of the members is dropped at 1/8, 1/4, 1/2 and all of
  the grid's steps (64 -> 4 members); the last 4 then train on until the budget is spent.

Members are picked on the validation set; the test set is reported.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import phalanx
import phalanx.population as population
from phalanx_tools.demo import MOMENTUM, Digits, _bar, _mlp

__all__ = ["run_population"]


@dataclass
class Result:
    """What one run produced."""

    name: str
    val: float  # best member's validation accuracy
    test: float  # that member's test accuracy
    lr: float  # that member's learning rate at the end
    seconds: float
    member_steps: int
    notes: list[str] = field(default_factory=list)


def _population(data: Digits, args: argparse.Namespace) -> Any:
    """The grid population: a stack, its SGD (per-member lr, isolation) and loader."""
    n, s = args.members, args.seeds
    lrs = torch.logspace(
        math.log10(args.lr_min), math.log10(args.lr_max), n // s, dtype=torch.float64
    )
    lrs = lrs.repeat_interleave(s)  # member i: lr index i // s, seed i % s
    seeds = torch.arange(s).repeat(n // s)
    stack = phalanx.stack(
        [_mlp(args.hidden, args.seed + int(k)) for k in seeds], backend=args.backend
    )
    opt = phalanx.optim.SGD(
        stack.parameters(), lr=lrs, momentum=MOMENTUM, skip_nonfinite=True,
        freeze_after=args.freeze_after, warn_skipped=False,
    )  # fmt: skip
    loader = phalanx.data.MemberLoader(
        data.x_train, data.y_train, num_members=n, batch_size=args.batch_size, bootstrap=True,
        drop_last=True, seed=args.seed,
    )  # fmt: skip
    loader.set_streams(range(n), seeds)  # member i reads its seed's resample, as in the sweep
    return stack, opt, loader


def _step(stack: phalanx.Stack, opt: phalanx.optim.SGD, batch: tuple[Tensor, Tensor]) -> None:
    xb, yb = batch  # (N, B, 64), (N, B)
    losses = phalanx.member_losses(F.cross_entropy, stack(xb, in_dims=0), yb, in_dims=(0, 0))
    opt.zero_grad()
    losses.sum().backward()
    opt.step(loss=losses)


def _batches(loader: phalanx.data.MemberLoader) -> Any:
    while True:
        yield from loader


def _accuracy(stack: phalanx.Stack, x: Tensor, y: Tensor) -> Tensor:
    with torch.no_grad():
        return phalanx.metrics.accuracy(stack(x), y)  # (N,)


def _best(name: Any, stack: Any, opt: Any, data: Any, seconds: Any, member_steps: Any) -> Result:
    val = _accuracy(stack, data.x_val, data.y_val)
    i = int(population._pbt.ranking(val, "max")[0])
    test = float(_accuracy(stack, data.x_test, data.y_test)[i])
    lr = float(opt.hyperparameters()["lr"][i])
    return Result(name, float(val[i]), test, lr, seconds, member_steps)


def _grid(data: Digits, args: argparse.Namespace, steps: int) -> Result:
    stack, opt, loader = _population(data, args)
    batches = _batches(loader)
    start = time.perf_counter()
    with _bar(steps, "grid") as bar:
        for _ in range(steps):
            _step(stack, opt, next(batches))
            bar.update()
    seconds = time.perf_counter() - start
    return _best("grid (fixed lr)", stack, opt, data, seconds, len(stack) * steps)


def _pbt(data: Digits, args: argparse.Namespace, steps: int, interval: int) -> Any:
    stack, opt, loader = _population(data, args)
    pbt = population.PBT(
        stack, opt, {"lr": population.LogUniform(args.lr_min, args.lr_max)},
        interval=interval, loader=loader, seed=args.seed, mode="max",
    )  # fmt: skip
    batches = _batches(loader)
    exploit_seconds = []
    start = time.perf_counter()
    with _bar(steps, "PBT") as bar:
        for step in range(1, steps + 1):
            _step(stack, opt, next(batches))
            if pbt.ready(step):
                val = _accuracy(stack, data.x_val, data.y_val)
                tick = time.perf_counter()
                pbt.exploit(val, step=step)
                exploit_seconds.append(time.perf_counter() - tick)
            bar.update()
    seconds = time.perf_counter() - start
    result = _best("PBT", stack, opt, data, seconds, len(stack) * steps)
    return result, pbt, exploit_seconds, stack, opt


def _halving(data: Digits, args: argparse.Namespace, steps: int) -> tuple[Result, Result, list]:
    """Successive halving; returns its result at the grid's steps and at equal compute."""
    stack, opt, loader = _population(data, args)
    budget = len(stack) * steps
    milestones = [steps // 8, steps // 4, steps // 2, steps]
    halving = population.SuccessiveHalving(stack, opt, milestones, loader=loader, mode="max")
    batches = _batches(loader)
    spent, step = 0, 0
    phases: list[tuple[int, int, float]] = []  # (members, steps, seconds) per rung
    early: Result | None = None
    start = phase_start = time.perf_counter()
    with _bar(None, "successive halving") as bar:
        while spent + len(halving.stack) <= budget:
            _step(halving.stack, opt, next(batches))
            step += 1
            spent += len(halving.stack)
            bar.update()
            if halving.ready(step):
                now = time.perf_counter()
                phases.append(
                    (len(halving.stack), step - sum(p[1] for p in phases), now - phase_start)
                )
                if step == steps:
                    early = _best("", halving.stack, opt, data, now - start, spent)
                val = _accuracy(halving.stack, data.x_val, data.y_val)
                halving.stop(val, step=step)  # the loader follows, from its next batch
                phase_start = time.perf_counter()
    now = time.perf_counter()
    phases.append((len(halving.stack), step - sum(p[1] for p in phases), now - phase_start))
    final = _best("successive halving, equal compute", halving.stack, opt, data, now - start, spent)
    final.notes.append(f"the last {len(halving.stack)} members trained {step} steps")
    assert early is not None
    early.name = "successive halving, stopped at the grid's steps"
    return early, final, phases


def _round_trip_seconds(args: argparse.Namespace) -> tuple[float, float]:
    """Median times to torch.save and torch.load one member's model and optimizer state, in
    memory and through a file (what a process-per-trial tool does between trials)."""
    model = _mlp(args.hidden, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=MOMENTUM)
    model(torch.zeros(1, 64)).sum().backward()
    opt.step()
    medians = []
    with tempfile.TemporaryDirectory(prefix="phalanx-demo-") as tmp:
        for target in (None, os.path.join(tmp, "member.pt")):
            times = []
            for _ in range(7):
                tick = time.perf_counter()
                where: str | io.BytesIO = io.BytesIO() if target is None else target
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, where)
                if isinstance(where, io.BytesIO):
                    where.seek(0)
                state = torch.load(where)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
                times.append(time.perf_counter() - tick)
            medians.append(statistics.median(times))
    return medians[0], medians[1]


def run_population(data: Digits, args: argparse.Namespace) -> int:
    """Runs the three at equal compute and prints the comparison; writes the schedules plot."""
    per_epoch = len(data.x_train) // args.batch_size
    steps = args.epochs * per_epoch
    interval = args.pbt_interval * per_epoch
    n = args.members
    print(
        f"\nGrid vs PBT vs successive halving, {n} members each, {n} x {steps} = {n * steps} "
        f"member-steps each (same seeds, initial weights and data streams)",
        flush=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", phalanx.optim.NonFiniteWarning)
        grid = _grid(data, args, steps)
        pbt_result, pbt, exploit_seconds, stack, opt = _pbt(data, args, steps, interval)
        early, halved, phases = _halving(data, args, steps)

    print(
        "\n  run                                               best val  its test   its lr   member-steps   wall"
    )
    for r in (grid, pbt_result, halved, early):
        print(
            f"  {r.name:49} {r.val:8.3f}  {r.test:8.3f}  {r.lr:7.3g}  {r.member_steps:13d}  {r.seconds:5.1f} s"
        )
    print(
        f"  ({halved.notes[0]}; wall times on {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f})"
    )
    runs = (grid, pbt_result, halved)
    by_val = max(runs, key=lambda r: r.val)
    by_test = max(runs, key=lambda r: r.test)
    print(
        f"  At equal compute: highest validation accuracy: {by_val.name}; highest test accuracy "
        f"(of the member picked on validation): {by_test.name}.\n"
        f"  PBT selects on the validation set at every exploit, so its validation figure is "
        f"optimistic; one of the {len(data.y_test)} test images is "
        f"{100 / len(data.y_test):.2f} points of accuracy."
    )

    print("\n  Successive halving, time per step as the stack shrinks:")
    merged: dict[int, tuple[int, float]] = {}  # a milestone that stops no one is no phase
    for members, count, seconds in phases:
        done, spent = merged.get(members, (0, 0.0))
        merged[members] = (done + count, spent + seconds)
    for members, (count, seconds) in merged.items():
        if count:
            print(
                f"    {members:3d} members: {count:6d} steps, {1e3 * seconds / count:6.2f} ms/step"
            )

    copied = len(pbt.log) // max(len(exploit_seconds), 1)
    exploit = statistics.median(exploit_seconds)
    copy_seconds = []  # the copy alone, on the trained population (it is done with)
    for _ in range(30):
        tick = time.perf_counter()
        population.copy_members(stack, range(copied), range(n - copied, n), optimizer=opt)
        copy_seconds.append(time.perf_counter() - tick)
    memory, disk = _round_trip_seconds(args)
    print(
        f"\n  One PBT exploit ({copied} of {n} members copied: weights, SGD momentum, step "
        f"counts, learning rates):\n    {1e3 * exploit:.2f} ms (median of {len(exploit_seconds)}), of which "
        f"the copy itself (copy_members) {1e3 * statistics.median(copy_seconds):.2f} ms"
        f"\n  One member's model + optimizer through torch.save + torch.load, what a "
        f"process-per-trial tool pays at least per copied member:\n"
        f"    in memory {1e3 * memory:.2f} ms, x {copied} members = {1e3 * memory * copied:.2f} ms"
        f"\n    through a file {1e3 * disk:.2f} ms, x {copied} members = "
        f"{1e3 * disk * copied:.2f} ms"
    )
    if args.pbt_plot:
        population.plot_population(
            pbt.history, pbt.log, path=args.pbt_plot,
            title=f"PBT of {n} networks on digits",
        )  # fmt: skip
        print(f"\n  Each member's learning-rate schedule: {os.path.abspath(args.pbt_plot)}")
    return 0
