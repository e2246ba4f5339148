"""``launch``: run a function on K local ranks without torchrun (tests, benchmarks, notebooks).

Ranks are fresh processes (the ``spawn`` start method) that meet through a file store in a
temporary directory, so no port is chosen or contended, and gloo talks over loopback only.
Each rank gets ``threads`` intra-op threads: ``torch.multiprocessing`` does not limit them,
and K ranks each using every core ran 10x slower than one thread each.

When the run fails, the rank to blame is the one that failed first on its own: a rank that
raised, else one that died without a word (``os._exit``, a signal, the OOM killer), never a
rank that only failed waiting for it in a collective, and never the survivor. Exit codes are
read before any rank is terminated, so a rank this launcher stopped is not mistaken for one
that died. Every wait is bounded by the ``timeout`` the user gave: a rank still running
``timeout`` seconds after another finished or failed is terminated and named.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from phalanx._errors import summary
from phalanx.distributed import _health
from phalanx.distributed._mesh import (
    DEFAULT_TIMEOUT,
    DistributedError,
    init,
    shutdown,
)

__all__ = ["launch"]

_POLL_S = 0.05
_GRACE_S = 5.0  # after a failure, how long the other ranks get to report theirs
_LAUNCH_FAILURE_TIMEOUT = 5.0  # local ranks: a dead one is named sooner than by the default


def _entry(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    world_size: int,
    store: str,
    timeout_s: float,
    threads: int,
    results: Any,
    failure_timeout: float | None,
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only, whatever interfaces exist
    torch.set_num_threads(threads)
    init(
        backend="gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        failure_timeout=failure_timeout,
    )
    _health.wait_in_collectives = False  # the parent names a dead rank from its exit code
    try:
        value = fn(*args)
    except BaseException as e:
        # Report before leaving the group: the parent names the rank that failed first, not
        # the ranks that then failed waiting for it.
        secondary = isinstance(e, DistributedError)
        _health.leave(f"failed: {summary(e, 300)}")
        results.put((rank, False, pickle.dumps((secondary, traceback.format_exc()))))
        raise SystemExit(1) from None
    else:
        results.put((rank, True, pickle.dumps(value)))
    finally:
        shutdown()


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT.total_seconds(),
    threads: int = 1,
    failure_timeout: float | None = None,
) -> list[Any]:
    """Runs ``fn(*args)`` on ``nprocs`` local CPU ranks in one gloo process group.

    Inside ``fn``, :func:`phalanx.distributed.shard` and the collectives work as under
    torchrun. Use torchrun for real jobs; this is for tests, benchmarks and notebooks on one
    machine.

    Args:
        fn: a module-level function (ranks are fresh processes that import it by name).
        nprocs: the number of ranks, K.
        *args: passed to ``fn`` on every rank; must be picklable.
        timeout: seconds. A collective waiting longer fails; once one rank has finished or
            failed, the others get this long to finish too, then are terminated and named.
            While every rank is running, the launch waits as long as the work takes.
        threads: intra-op threads per rank.
        failure_timeout: the failure detector's deadline, as for
            :func:`phalanx.distributed.init`; None: the smaller of ``timeout`` and 5 s.

    Returns:
        ``fn``'s return value on each rank, by rank (each must be picklable).

    Raises:
        TypeError: ``fn`` or ``args`` cannot be pickled (a lambda, a nested function).
        DistributedError: a rank raised, died or hung. The message names the rank that
            failed first (with its traceback, or its exit code or signal if it died without
            one) and the ranks that failed after it.

    Example:
        >>> def work():  # in a module or script: the ranks import it by name
        ...     stack, shard = phalanx.distributed.shard(lambda i: nn.Linear(4, 2), num_members=8)
        ...     return shard.global_indices
        >>> work()  # in a plain process, the one rank holds every member
        range(0, 8)
        >>> phalanx.distributed.launch(work, 2)  # doctest: +SKIP
        [range(0, 4), range(4, 8)]
    """
    where = "phalanx.distributed.launch()"
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"{where}: nprocs must be a positive int; got {nprocs!r}.")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ValueError(f"{where}: timeout must be a positive number of seconds; got {timeout!r}.")
    try:
        pickle.dumps((fn, args))
    except Exception as e:
        raise TypeError(
            f"{where}: fn and args must be picklable, since ranks are fresh processes that "
            f"import fn by name: pass a module-level function, not a lambda or a nested "
            f"function ({type(e).__name__}: {e})."
        ) from e
    if failure_timeout is None:
        failure_timeout = min(float(timeout), _LAUNCH_FAILURE_TIMEOUT)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    run = _Run(nprocs, float(timeout))
    with tempfile.TemporaryDirectory(prefix="phalanx-launch-") as tmp:
        store = os.path.join(tmp, "store")
        processes = [
            ctx.Process(
                target=_entry,
                args=(
                    r,
                    fn,
                    args,
                    nprocs,
                    store,
                    float(timeout),
                    threads,
                    results,
                    failure_timeout,
                ),
                daemon=True,
            )
            for r in range(nprocs)
        ]
        try:
            for p in processes:
                p.start()
            run.watch(processes, results)
        finally:
            for p in processes:
                if p.is_alive():
                    p.kill()
                p.join()
            results.close()
    if run.failed():
        raise DistributedError(run.report(where))
    return run.out


class _Run:
    """What the ranks reported and how they ended, read while waiting for them."""

    def __init__(self, nprocs: int, timeout: float) -> None:
        self.nprocs = nprocs
        self.timeout = timeout
        self.out: list[Any] = [None] * nprocs
        self.ok: set[int] = set()
        self.errors: dict[int, tuple[bool, str]] = {}
        self.codes: dict[int, int] = {}  # exit codes of ranks that ended by themselves
        self.hung: list[int] = []
        self.first_end: float | None = None
        self.first_failure: float | None = None

    def watch(self, processes: list[Any], results: Any) -> None:
        """Waits until every rank has ended, or terminates the ranks ``timeout`` s late."""
        while True:
            self._drain(results)  # a rank blocks on a full pipe until its result is read
            now = time.monotonic()
            for r, p in enumerate(processes):
                if r not in self.codes and p.exitcode is not None:
                    self.codes[r] = p.exitcode
                    self.first_end = self.first_end or now
            if len(self.codes) == self.nprocs:
                self._drain(results)
                return
            if self.first_failure is None and any(c != 0 for c in self.codes.values()):
                self.first_failure = now
            if self._stuck(now):
                self._drain(results)
                silent = set(self.codes) | set(self.errors) | self.ok
                self.hung = [r for r in range(self.nprocs) if r not in silent]
                for p in processes:
                    if p.exitcode is None:
                        p.kill()
                return
            time.sleep(_POLL_S)

    def _stuck(self, now: float) -> bool:
        """Whether to stop waiting for the ranks still running."""
        if self.first_failure is not None:
            # A rank that raised or died breaks the others' collectives at once; they report
            # their own errors within moments. One still silent after that hangs outside
            # any collective, or works on without one: the run has failed either way.
            accounted = self.ok | set(self.errors) | set(self.codes)
            grace = min(self.timeout, _GRACE_S)
            return len(accounted) == self.nprocs or now - self.first_failure > grace
        # Every rank that ended so far succeeded: the others get `timeout` more seconds (a
        # rank that hangs after its last collective makes no collective time out).
        return self.first_end is not None and now - self.first_end > self.timeout

    def _drain(self, results: Any) -> None:
        while not results.empty():
            rank, ok, payload = results.get()
            if ok:
                self.out[rank] = pickle.loads(payload)
                self.ok.add(rank)
            else:
                self.errors[rank] = pickle.loads(payload)

    def failed(self) -> bool:
        return bool(self.hung) or len(self.ok) < self.nprocs

    def _death(self, rank: int) -> str:
        code = self.codes.get(rank)
        if code is None:
            return "did not finish"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"was killed by {name}"
        return f"exited with code {code}"

    def report(self, where: str) -> str:
        """Names the rank that failed first on its own, then the others."""
        raised = sorted(r for r, (secondary, _) in self.errors.items() if not secondary)
        died = sorted(r for r, c in self.codes.items() if r not in self.errors and r not in self.ok)
        waited = sorted(r for r, (secondary, _) in self.errors.items() if secondary)
        if raised:
            first = raised[0]
            message = f"{where}: rank {first} failed:\n{self.errors[first][1]}"
        elif died:
            first = died[0]
            message = (
                f"{where}: rank {first} {self._death(first)} without raising an exception "
                f"(os._exit, a crash in native code, a signal or the out-of-memory killer), so "
                f"it left no traceback."
            )
        elif self.hung and not waited:
            first = self.hung[0]
            finished = sorted(self.ok)
            message = (
                f"{where}: rank {first} had not finished {self.timeout:g} s after rank "
                f"{finished[0] if finished else '?'} finished; it was terminated. A rank "
                f"that hangs after its last collective is stopped after timeout= seconds; "
                f"pass a larger timeout= if its work is simply long."
            )
        elif self.hung:
            first = self.hung[0]
            message = (
                f"{where}: rank {first} was still running when the other ranks failed waiting "
                f"for it in a collective (it hangs, or works longer than the timeout, "
                f"{self.timeout:g} s); it was terminated. The first error of the others:\n"
                f"{self.errors[waited[0]][1]}"
            )
        else:
            first = waited[0]
            message = f"{where}: rank {first} failed:\n{self.errors[first][1]}"
        others = sorted((set(raised) | set(died) | set(waited) | set(self.hung)) - {first})
        if others:
            message += f"\nRanks {others} then failed too (after rank {first})."
        return message
