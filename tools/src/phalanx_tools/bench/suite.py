"""Runs the workloads: check every contender against the loop, then time them interleaved.

For each workload and phase the suite builds every contender from the same members and data,
runs each once and compares the result with the loop's (the forward output; or the per-member
losses, the gradients and, after one Adam step, the parameters and buffers). A contender that
raises is "n/a", one that disagrees is "WRONG"; neither is timed. The others are timed round
by round, interleaved (see :mod:`phalanx_tools.bench.timing`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

import phalanx
from phalanx_tools.bench.contenders import Contender, Runner, default_contenders
from phalanx_tools.bench.machine import Machine
from phalanx_tools.bench.timing import interleaved, peak_memory
from phalanx_tools.bench.workloads import WORKLOADS, Data, Workload, build, cost

PHASES = ("forward", "train")

#: The correctness check compares float32 contenders with the float32 loop through
#: phalanx.testing.assert_close's trajectory tolerances (there is no float64 run to earn a
#: bound from: the timed code is float32); the exactness proof is the test suite's.
#: Adam's first step is about lr * sign(gradient): where the loop's gradient is below this,
#: rounding decides the sign, so those elements are left out of the parameter comparison.
TINY_GRADIENT = 1e-6


class Progress(Protocol):
    """What the suite reports progress to: a ``tqdm`` bar fits."""

    def set_description(self, desc: str) -> None: ...

    def update(self, n: int) -> Any: ...


class _NoProgress:
    def set_description(self, desc: str) -> None:
        pass

    def update(self, n: int) -> None:
        pass


@dataclass(frozen=True)
class Settings:
    """How hard to time: see :func:`phalanx_tools.bench.timing.interleaved`."""

    rounds: int
    min_rounds: int
    warmup: int
    target_s: float
    budget_s: float


QUICK = Settings(rounds=3, min_rounds=3, warmup=1, target_s=0.002, budget_s=1.0)
FULL = Settings(rounds=25, min_rounds=7, warmup=3, target_s=0.02, budget_s=30.0)


@dataclass
class Row:
    """One contender in one workload and phase. Times in seconds per call.

    ``status`` is "ok" (checked and timed), "WRONG" (disagrees with the loop: not timed) or
    "n/a" (raised: not timed); ``reason`` says why. Speed-ups are this row's time against
    the loop's and torch.func's (above 1: this row is faster). ``compile_s``: seconds spent
    tracing and compiling (phalanx:compiled), else None.
    """

    name: str
    kind: str
    status: str
    reason: str = ""
    note: str = ""
    median_s: float | None = None
    q1_s: float | None = None
    q3_s: float | None = None
    min_s: float | None = None
    max_s: float | None = None
    rounds: int = 0
    calls_per_round: int = 0
    peak_memory_bytes: int | None = None
    compile_s: float | None = None
    gflops: float | None = None
    fraction_of_peak: float | None = None
    times_floor: float | None = None
    vs_loop: float | None = None
    vs_torch_func: float | None = None


@dataclass
class Result:
    """One workload in one phase: its cost, its floor and every contender's row."""

    workload: str
    description: str
    phase: str
    flops: int
    bytes: int
    floor_s: float
    memory_method: str
    rows: list[Row] = field(default_factory=list)

    def row(self, name: str) -> Row | None:
        return next((r for r in self.rows if r.name == name), None)

    def best_phalanx(self) -> Row | None:
        """The fastest phalanx backend that passed, ``auto`` aside."""
        ok = [r for r in self.rows if r.kind == "phalanx" and r.status == "ok"]
        ok = [r for r in ok if r.name != "phalanx:auto" and r.median_s is not None]
        return min(ok, key=lambda r: r.median_s or 0.0, default=None)


def reason_of(error: BaseException) -> str:
    """``Type: first line of the message``, short enough for a table."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= 200 else text[:197] + "..."


def observe(runner: Runner, phase: str) -> dict[str, Any]:
    """Runs one call of ``phase`` and returns what the check compares."""
    if phase == "forward":
        with torch.no_grad():
            return {"output": runner.forward()}
    losses = runner.backward()
    grads: dict[str, Any] | None = None
    if not getattr(runner, "whole_step", False):  # a captured step keeps no gradients
        grads = {k: None if g is None else g.clone() for k, g in runner.grads().items()}
    runner.step()
    return {"losses": losses, "grads": grads, "state": runner.state()}


def _close(actual: Any, expected: Any, what: str) -> str | None:
    try:
        phalanx.testing.assert_close(actual, expected, trajectory=True)
    except AssertionError as e:
        return f"{what}: " + " ".join(str(e).split())
    return None


def mismatch(got: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """Why ``got`` disagrees with the loop's ``expected``, or None when it agrees."""
    if "output" in expected:
        return _close(got["output"], expected["output"], "forward output")
    for what in ("grads", "state"):
        if got[what] is None:
            continue  # not observable for this contender (the captured step's gradients)
        missing = set(expected[what]) ^ set(got[what])
        if missing:
            return f"{what}: names differ from the loop's: {sorted(missing)}"
    problem = _close(got["losses"], expected["losses"], "per-member losses")
    for name, g in expected["grads"].items() if got["grads"] is not None else ():
        if got["grads"][name] is None:
            problem = problem or f"gradient of {name!r}: missing (None), the loop has one"
        problem = problem or _close(got["grads"][name], g, f"gradient of {name!r}")
    for name, value in expected["state"].items():
        actual = got["state"][name]
        if name in expected["grads"]:  # a parameter: skip where Adam's sign is rounding's
            actual = torch.where(expected["grads"][name].abs() < TINY_GRADIENT, value, actual)
        problem = problem or _close(actual, value, f"{name!r} after one Adam step")
    return problem


def _checked(runner: Runner, phase: str, row: Row) -> dict[str, Any] | None:
    """Runs ``observe`` and records a failure or warnings in ``row``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = observe(runner, phase)
        except Exception as e:
            row.status, row.reason = "n/a", reason_of(e)
            return None
    notes = dict.fromkeys(str(w.message).splitlines()[0] for w in caught)
    row.note = "; ".join(filter(None, [runner.note(), *notes]))
    return got


def _call(runner: Runner, phase: str) -> Callable[[], None]:
    if phase == "forward":

        def forward() -> None:
            with torch.no_grad():
                runner.forward()

        return forward

    def train_step() -> None:
        runner.backward()
        runner.step()

    return train_step


def run_phase(
    workload: Workload,
    phase: str,
    members: list[nn.Module],
    data: Data,
    contenders: list[Contender],
    *,
    device: torch.device,
    settings: Settings,
    machine: Machine,
    progress: Progress | None = None,
) -> Result:
    """Checks and times every contender on one workload in one phase.

    Args:
        workload: the workload.
        phase: "forward" (no grad, members in eval mode) or "train" (forward, per-member
            loss, backward, Adam step; members in train mode).
        members: the N members; only their train/eval mode is changed.
        data: inputs and targets.
        contenders: the reference loop first, then the others.
        device: where everything runs.
        settings: rounds, warm-up and budget.
        machine: the measured limits, for GFLOP/s fraction and floor.
        progress: advanced by ``settings.rounds`` over the phase, one per timing round.

    Returns:
        The result, one row per contender in the given order.

    Raises:
        RuntimeError: the reference loop itself fails.
    """
    progress = progress or _NoProgress()
    progress.set_description(f"{workload.id} {phase}")
    for m in members:
        m.train(phase == "train")
    flops, moved = cost(workload).for_phase(phase)
    floor = max(flops / (machine.gemm_gflops * 1e9), moved / (machine.bandwidth_gbs * 1e9))
    result = Result(workload.id, workload.describe(), phase, flops, moved, floor, "")
    runners: dict[str, Runner] = {}
    expected: dict[str, Any] | None = None
    for k, c in enumerate(contenders):
        if c.train_only and phase != "train":
            continue
        row = Row(c.name, c.kind, "ok")
        result.rows.append(row)
        try:
            runner = c.build(members, data, workload)
        except Exception as e:
            row.status, row.reason = "n/a", reason_of(e)
        else:
            got = _checked(runner, phase, row)
            compile_seconds = getattr(runner, "compile_seconds", None)
            row.compile_s = compile_seconds() if compile_seconds is not None else None
        if k == 0:  # the reference
            if row.status != "ok":
                raise RuntimeError(f"phalanx bench: the reference {c.name!r} failed: {row.reason}")
            expected = got
        elif row.status == "ok":
            try:
                problem = mismatch(got, expected)  # type: ignore[arg-type]
            except Exception as e:  # e.g. an output of another shape
                problem = f"cannot be compared with the loop's: {reason_of(e)}"
            if problem:
                row.status, row.reason = "WRONG", problem[:300]
        if row.status == "ok":
            runners[c.name] = runner

    calls: dict[str, Callable[[], object]] = {n: _call(r, phase) for n, r in runners.items()}
    rows = {row.name: row for row in result.rows}
    for name, call in calls.items():
        rows[name].peak_memory_bytes, result.memory_method = peak_memory(call, device)
    s = settings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each warning was recorded once by the check
        timings = interleaved(
            calls,
            device=device,
            rounds=s.rounds,
            min_rounds=s.min_rounds,
            warmup=s.warmup,
            target_s=s.target_s,
            budget_s=s.budget_s,
            on_round=lambda: progress.update(1),
        )
    rounds_done = len(next(iter(timings.values())).samples) if timings else 0
    progress.update(s.rounds - rounds_done)
    for name, t in timings.items():
        row = rows[name]
        row.median_s, (row.q1_s, row.q3_s) = t.median, t.iqr
        row.min_s, row.max_s = min(t.samples), max(t.samples)
        row.rounds, row.calls_per_round = len(t.samples), t.calls_per_round
        row.gflops = flops / t.median / 1e9
        row.fraction_of_peak = row.gflops / machine.gemm_gflops
        row.times_floor = t.median / floor
    _speedups(result)
    return result


def _speedups(result: Result) -> None:
    for base, attr in (("loop", "vs_loop"), ("torch.func", "vs_torch_func")):
        ref = result.row(base)
        if ref is None or ref.median_s is None:
            continue
        for row in result.rows:
            if row.median_s is not None:
                setattr(row, attr, ref.median_s / row.median_s)


def run_suite(
    workload_ids: list[str],
    phases: list[str],
    *,
    device: torch.device,
    settings: Settings,
    machine: Machine,
    contenders: list[Contender] | None = None,
    progress: Progress | None = None,
    seed: int = 0,
) -> list[Result]:
    """Runs :func:`run_phase` for every workload and phase, building each workload once.

    Args:
        workload_ids: e.g. ["W2", "W3"].
        phases: a subset of ("forward", "train").
        device: where everything runs.
        settings: rounds, warm-up and budget.
        machine: the measured limits.
        contenders: the loop first; :func:`default_contenders` by default.
        progress: advanced by ``settings.rounds`` per workload and phase.
        seed: the base seed of weights and data.

    Returns:
        One result per workload and phase, in that order.
    """
    contenders = contenders or default_contenders()
    results = []
    for wid in workload_ids:
        workload = WORKLOADS[wid]
        members, data = build(workload, device=device, seed=seed)
        for phase in phases:
            results.append(
                run_phase(
                    workload,
                    phase,
                    members,
                    data,
                    contenders,
                    device=device,
                    settings=settings,
                    machine=machine,
                    progress=progress,
                )
            )
    return results
