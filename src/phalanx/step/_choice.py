"""The captured step or the eager one: the timing rule, and its record on disk.

After the capture, ``CompiledStep`` alternates captured and eager steps, :data:`ROUNDS` of
each, and keeps the captured step unless its median is slower than the eager step's by more
than :data:`MARGIN` (:func:`decide`). The eager steps before the capture are not counted
(the first settles the stack's backend; all run with cold caches), nor is the capture's own
call (it compiles). Alternating and medians make one slow sample (another process taking the
core) harmless; under ``torch.distributed`` every rank's medians are exchanged and every rank
reaches the same choice (:func:`agree`).

The choice is recorded beside inductor's on-disk caches (:class:`Records`), keyed by what
determines it: the traced graph and its input shapes, torch's version, the device, the
thread count, the compiler and its mode. A later run of the same step on the same machine
reads it and skips the timing: one eager step, then the step it chose before.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from phalanx import _torch_compat as compat

__all__ = ["MARGIN", "ROUNDS", "Records", "agree", "clear", "decide", "exchange", "ratio"]

Prefer = Literal["fastest", "captured"]
Choice = Literal["eager", "captured"]

#: Captured and eager steps timed alternately after the capture, each this many times.
ROUNDS = 5
#: The captured step is kept unless its median is slower than the eager one's by more.
MARGIN = 0.05


def decide(eager_s: list[float], captured_s: list[float], margin: float = MARGIN) -> Choice:
    """The captured step unless it is slower than the eager step by more than ``margin`` (its
    compilation is paid, and a near tie is noise).

    Samples taken alternately (as many of each, ``captured_s[i]`` just before
    ``eager_s[i]``) are compared pair by pair: the median of ``captured_s[i] / eager_s[i]``.
    Each pair ran under nearly the same load, so a load that changes during the timing
    (another process starting) moves both sides of a pair, and the median of the ratios
    nowhere. Otherwise (one median per rank: see ``agree``) the medians are compared.

    Args:
        eager_s: seconds of eager steps (samples, or one median per rank).
        captured_s: seconds of captured steps, likewise.
        margin: how much slower than the eager step the captured one may be and be kept.

    Returns:
        "captured" or "eager".
    """
    return "captured" if ratio(eager_s, captured_s) <= 1 + margin else "eager"


def ratio(eager_s: list[float], captured_s: list[float]) -> float:
    """The captured step's time over the eager step's: the median of the pairs' ratios where
    the samples pair up, else the ratio of the medians (see ``decide``)."""
    if len(eager_s) == len(captured_s) > 1:
        return statistics.median(c / e for c, e in zip(captured_s, eager_s, strict=True))
    return statistics.median(captured_s) / statistics.median(eager_s)


def clear(eager_s: list[float], captured_s: list[float], margin: float = MARGIN) -> bool:
    """Whether alternate samples decide clearly: the pairs' ratios (see ``decide``), the
    fastest and the slowest left out, all on one side of ``1 + margin``. A choice that is
    not clear (a near tie, or another process taking the cores during the timing) is kept
    for this run and not recorded for later ones."""
    ratios = sorted(c / e for c, e in zip(captured_s, eager_s, strict=True))
    middle = ratios[1:-1] if len(ratios) > 2 else ratios
    return all(r <= 1 + margin for r in middle) or all(r > 1 + margin for r in middle)


def agree(table: list[tuple[float, float]], margin: float = MARGIN) -> Choice:
    """One choice for every rank from every rank's ``(eager, captured)`` medians: ranks step
    together, so the slowest rank's time counts on each side. Every rank judges the same
    table, so every rank reaches the same choice."""
    return decide([max(e for e, _ in table)], [max(c for _, c in table)], margin)


def exchange(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (``all_gather_object`` on the default group); ``[obj]`` alone."""
    if not distributed():
        return [obj]
    table: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(table, obj)
    return table


def distributed() -> bool:
    """Whether this process is one of several ranks of ``torch.distributed``."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def median(times: list[float]) -> float | None:
    return statistics.median(times) if times else None


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g} ms"


def synchronizer(stack: Any) -> Callable[[], None]:
    """What makes a timing include the device's queued work (CUDA), or nothing (CPU)."""
    p = next(stack.parameters(), None)
    if p is not None and p.is_cuda:
        return torch.cuda.synchronize
    return lambda: None


class Records:
    """The choices made on this machine, one small JSON file each, in ``folder``.

    A record holds the choice and the two medians it was made on. A file that cannot be read
    or written is no record: the step times itself, as the first run did.
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder

    @staticmethod
    def here() -> Records | None:
        """The records beside inductor's cache (``TORCHINDUCTOR_CACHE_DIR``), or None where
        torch has no such folder. None under ``torch.distributed``: the ranks would have to
        agree on records each read alone, so there every run times itself."""
        folder = compat.inductor_cache_dir()
        if folder is None or distributed():
            return None
        return Records(os.path.join(folder, "phalanx_step_choice"))

    def path(self, key: str) -> str:
        return os.path.join(self.folder, f"{key}.json")

    def read(self, key: str) -> dict[str, Any] | None:
        try:
            with open(self.path(key)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            return None
        fields = ("eager_s", "captured_s")
        if not isinstance(record, dict) or record.get("choice") not in ("eager", "captured"):
            return None
        if not all(isinstance(record.get(k), float | int) for k in fields):
            return None
        return record

    def write(self, key: str, choice: Choice, eager_s: float, captured_s: float) -> None:
        record = {"choice": choice, "eager_s": eager_s, "captured_s": captured_s}
        try:
            os.makedirs(self.folder, exist_ok=True)
            temporary = f"{self.path(key)}.{os.getpid()}"
            with open(temporary, "w") as f:
                json.dump(record, f)
            os.replace(temporary, self.path(key))  # atomic: a reader sees all or nothing
        except OSError:
            pass  # a read-only cache folder: later runs time themselves


def choice_key(graph: Any, inputs: list[Tensor], backend: Any, mode: str | None) -> str:
    """What the choice between captured and eager depends on, hashed: the graph's code and its
    inputs' shapes, strides and dtypes, torch's version, the device, the thread count, the
    compiler and its mode."""
    device = inputs[0].device if inputs else torch.device("cpu")
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} {torch.version.cuda}"
    else:
        where = f"{platform.machine()} {platform.processor()} {os.cpu_count()} cpus"
    parts = [
        graph.code,
        repr([(tuple(t.shape), t.stride(), t.dtype) for t in inputs]),
        torch.__version__,
        where,
        str(torch.get_num_threads()),
        repr(backend),
        repr(mode),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
