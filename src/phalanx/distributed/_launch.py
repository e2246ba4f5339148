"""``launch``: run a function on K local ranks without torchrun (tests, benchmarks, notebooks).

Ranks are fresh processes (the ``spawn`` start method) that meet through a file store in a
temporary directory, so no port is chosen or contended, and gloo talks over loopback only.
Each rank gets ``threads`` intra-op threads: ``torch.multiprocessing`` does not limit them,
and K ranks each using every core ran 10x slower than one thread each.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from phalanx.distributed._mesh import DEFAULT_TIMEOUT, DistributedError, init, shutdown

__all__ = ["launch"]


def _entry(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    world_size: int,
    store: str,
    timeout_s: float,
    threads: int,
    results: Any,
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only, whatever interfaces exist
    torch.set_num_threads(threads)
    init(
        backend="gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        value = fn(*args)
    except BaseException as e:
        # Report before leaving the group: the parent names the rank that failed first, not
        # the ranks that then failed waiting for it.
        secondary = isinstance(e, DistributedError)
        results.put((rank, False, pickle.dumps((secondary, traceback.format_exc()))))
        raise
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
) -> list[Any]:
    """Runs ``fn(*args)`` on ``nprocs`` local CPU ranks in one gloo process group.

    Inside ``fn``, :func:`phalanx.distributed.shard` and the collectives work as under
    torchrun. Use torchrun for real jobs; this is for tests, benchmarks and notebooks on one
    machine.

    Args:
        fn: a module-level function (ranks are fresh processes that import it by name).
        nprocs: the number of ranks, K.
        *args: passed to ``fn`` on every rank; must be picklable.
        timeout: seconds; a collective waiting longer fails, and so does the launch if the
            ranks have not finished after three times this.
        threads: intra-op threads per rank.

    Returns:
        ``fn``'s return value on each rank, by rank (each must be picklable).

    Raises:
        TypeError: ``fn`` or ``args`` cannot be pickled (a lambda, a nested function).
        DistributedError: a rank raised or died (its traceback is in the message), or the
            ranks did not finish in time.

    Example:
        >>> def work():
        ...     stack, shard = phalanx.distributed.shard(make_member, num_members=8)
        ...     return shard.global_indices
        >>> phalanx.distributed.launch(work, 2)
        [range(0, 4), range(4, 8)]
    """
    where = "phalanx.distributed.launch()"
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"{where}: nprocs must be a positive int; got {nprocs!r}.")
    try:
        pickle.dumps((fn, args))
    except Exception as e:
        raise TypeError(
            f"{where}: fn and args must be picklable, since ranks are fresh processes that "
            f"import fn by name: pass a module-level function, not a lambda or a nested "
            f"function ({type(e).__name__}: {e})."
        ) from e
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="phalanx-launch-") as tmp:
        store = os.path.join(tmp, "store")
        processes = mp.start_processes(
            _entry,
            args=(fn, args, nprocs, store, float(timeout), threads, results),
            nprocs=nprocs,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + 3 * timeout + 60
        out: list[Any] = [None] * nprocs
        errors: dict[int, tuple[bool, str]] = {}
        try:
            # Read results while waiting: a rank blocks on a full pipe until they are read.
            while not processes.join(timeout=0.2):
                _drain(results, out, errors)
                if time.monotonic() > deadline:
                    raise DistributedError(
                        f"{where}: the {nprocs} ranks did not finish within "
                        f"{3 * timeout + 60:g} s; they were terminated. Pass a larger "
                        f"timeout= if the work is simply long."
                    )
        except ProcessException as e:
            _drain(results, out, errors)
            raise DistributedError(_failure(where, e, errors)) from e
        finally:
            for p in processes.processes:
                if p.is_alive():
                    p.terminate()
                p.join()
    _drain(results, out, errors)
    return out


def _drain(results: Any, out: list[Any], errors: dict[int, tuple[bool, str]]) -> None:
    while not results.empty():
        rank, ok, payload = results.get()
        if ok:
            out[rank] = pickle.loads(payload)
        else:
            errors[rank] = pickle.loads(payload)


def _failure(where: str, e: ProcessException, errors: dict[int, tuple[bool, str]]) -> str:
    """Names the rank that failed first: one that raised on its own, not a collective's victim."""
    if not errors:
        return f"{where}: rank {e.error_index} failed:\n{e}"
    first = min(errors, key=lambda r: (errors[r][0], r))
    message = f"{where}: rank {first} failed:\n{errors[first][1]}"
    others = sorted(set(errors) - {first})
    if others:
        message += f"\nRanks {others} then failed too (their collectives lost rank {first})."
    return message
