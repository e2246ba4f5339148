"""A failure detector: every rank beats a counter in the c10d store; a silent rank is named.

Members are independent, so a training step makes no collective call, and a rank whose peer
died would otherwise learn of it only at the next gather or save, minutes later, and then
blame itself. Here each rank runs a daemon thread that, every ``interval`` seconds, adds 1
to its own counter in the job's store (a separate client, cloned, so the main thread's store
calls never delay a beat) and reads the counters of the next two live ranks after it (a
ring, so the store sees O(1) requests per rank whatever the number of nodes). A counter that
has not moved for ``deadline`` seconds, by the watcher's own monotonic clock (no clock is
shared between machines), names its rank dead. The verdict is published in the store, so
every rank learns it within one interval, printed to stderr, and raised in the main thread
as a :class:`DistributedError` (a SIGUSR1 that wakes it from sleeps and blocking calls). A
main thread that is stuck in native code (a collective waiting on a machine that vanished)
and does not take the exception within ``deadline`` more seconds ends the process with exit
code 1, so torchrun can stop or restart the job. Checkpoints are transactions, so whatever
was last committed stays whole and loads.

A rank that leaves cleanly (``shutdown()``, the end of the interpreter) says so first and is
not reported; one that raises an uncaught exception says so and is reported, with the
exception, at once. A store that stops answering for ``deadline`` seconds is reported too:
it lives with rank 0 (``env://``) or torchrun's agent on the rendezvous host.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from phalanx._errors import summary
from phalanx.distributed._errors import DistributedError

__all__ = ["Monitor", "current", "leave", "start", "stop", "verdict"]

_PREFIX = "phalanx/health"
_monitor: Monitor | None = None
_last_checkpoint: str | None = None
# Whether a failed collective waits for the verdict to name the dead rank. pdist.launch
# turns it off: its parent names the rank from exit codes, without waiting for a deadline.
wait_in_collectives = True


def note_checkpoint(text: str) -> None:
    """Remembers the last committed checkpoint, for the verdict's advice."""
    global _last_checkpoint
    _last_checkpoint = text


class Monitor:
    """The heartbeat thread of this rank, and what it found."""

    def __init__(
        self, store: Any, rank: int, world_size: int, interval: float, deadline: float, run: str
    ) -> None:
        # ``run`` is drawn by rank 0 and sent to all at init: keys of an earlier group in the
        # same store (torchrun keeps one across restarts) are never read. Not the restart
        # count: each torchrun agent counts its own, so ranks of one round disagree on it.
        self.prefix = f"{_PREFIX}/{run}"
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self.deadline = deadline
        self.found: str | None = None  # the verdict, once there is one
        self.raised = False  # the main thread has been given the verdict
        self.left = False
        self.pid = os.getpid()  # a forked child (a data loader's worker) is not this rank
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._signal = False  # whether our SIGUSR1 handler is installed
        self._thread = threading.Thread(target=self._run, name="phalanx-heartbeat", daemon=True)

    def _key(self, what: str, rank: int | None = None) -> str:
        return f"{self.prefix}/{what}" if rank is None else f"{self.prefix}/{what}/{rank}"

    def start(self) -> None:
        self.store.set(self._key("host", self.rank), f"{socket.gethostname()} pid {os.getpid()}")
        self.store.add(self._key("beat", self.rank), 1)
        self._install_signal()
        self._thread.start()

    # ---------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        seen: dict[int, tuple[int, float]] = {}  # rank: (its counter, when it last moved)
        gone: set[int] = set()  # ranks that left cleanly
        store_silent_since: float | None = None
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if not dist.is_initialized():  # the program left the group without shutdown()
                return
            try:
                self.store.add(self._key("beat", self.rank), 1)
                if self.store.check([self._key("dead")]):
                    self._fail(self.store.get(self._key("dead")).decode(), publish=False)
                    return
                for r in self._watched(gone):
                    if self.store.check([self._key("left", r)]):
                        why = self.store.get(self._key("left", r)).decode()
                        if why.startswith("failed"):
                            self._fail(f"rank {r} ({self._host(r)}) {why}")
                            return
                        gone.add(r)
                        seen.pop(r, None)
                        continue
                    count = int(self.store.add(self._key("beat", r), 0))
                    if r not in seen or seen[r][0] != count:
                        seen[r] = (count, now)
                    elif now - seen[r][1] > self.deadline:
                        self._fail(
                            f"rank {r} ({self._host(r)}) stopped: its heartbeat has not moved "
                            f"for {now - seen[r][1]:.1f} s (deadline {self.deadline:g} s); it "
                            f"died, its machine went down or its network was cut"
                        )
                        return
                store_silent_since = None
            except Exception as e:  # the store's own errors: it is gone or unreachable
                store_silent_since = store_silent_since or now
                if now - store_silent_since > self.deadline:
                    self._fail(
                        f"the job's c10d store has not answered for "
                        f"{now - store_silent_since:.1f} s ({summary(e, 200)}); "
                        f"the machine that holds it (rank 0's, or torchrun's rendezvous host) "
                        f"most likely died",
                        publish=False,
                    )
                    return

    def _watched(self, gone: set[int]) -> list[int]:
        """The next two ranks after this one that have not left: a ring over the ranks."""
        out = []
        for step in range(1, self.world_size):
            r = (self.rank + step) % self.world_size
            if r not in gone:
                out.append(r)
                if len(out) == 2:
                    break
        return out

    # ------------------------------------------------------------------- collective arrivals

    def arrive(self, what: str) -> int | None:
        """Counts this rank's arrival at its next phalanx collective (and says which), so a
        rank that waits in vain can name the ranks that never came; None if the store fails."""
        try:
            count = int(self.store.add(self._key("arrived", self.rank), 1))
            self.store.set(self._key("at", self.rank), what)
            return count
        except Exception:
            return None

    def not_arrived(self, count: int) -> list[str]:
        """The ranks that have not reached this rank's collective number ``count``, each
        with the phalanx call it made last."""
        late = []
        try:
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                theirs = int(self.store.add(self._key("arrived", r), 0))
                if theirs >= count:
                    continue
                at = self._key("at", r)
                last = self.store.get(at).decode() if self.store.check([at]) else ""
                late.append(
                    f"rank {r} ({self._host(r)}) did not arrive: it is alive but has made "
                    f"{theirs} phalanx collective call(s) to this rank's {count}, the last "
                    f"{last!r}"
                    if last
                    else f"rank {r} ({self._host(r)}) did not arrive: it "
                    f"has made no phalanx collective call yet"
                )
        except Exception:
            return []
        return late

    def _host(self, rank: int) -> str:
        try:
            if self.store.check([self._key("host", rank)]):
                return str(self.store.get(self._key("host", rank)).decode())
        except Exception:
            pass
        return "host unknown"

    def _fail(self, message: str, *, publish: bool = True) -> None:
        if publish:  # the first verdict wins, and every rank reads it within one interval
            with contextlib.suppress(Exception):
                message = self.store.compare_set(self._key("dead"), "", message).decode()
        if _last_checkpoint is not None:
            message += f". The last checkpoint this rank committed, {_last_checkpoint}, is whole"
        self.found = (
            f"phalanx.distributed: rank {self.rank} of {self.world_size}: {message}. This rank "
            f"stops too; restart the job from its last checkpoint (torchrun --max-restarts "
            f"does it for you)."
        )
        print(f"[phalanx] {self.found}", file=sys.stderr, flush=True)
        if self._signal:
            signal.pthread_kill(self._main, signal.SIGUSR1)  # type: ignore[arg-type]
        if self._stop.wait(self.deadline) or self.raised:
            return
        print(
            f"[phalanx] rank {self.rank}: the main thread did not take the error within "
            f"{self.deadline:g} s (it is blocked in native code); exiting with code 1.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    # ----------------------------------------------------------------------- main thread side

    def _install_signal(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
            return  # the program's own handler: leave it; the verdict waits for a collective
        signal.signal(signal.SIGUSR1, _on_signal)
        self._signal = True

    def take(self) -> str | None:
        """The verdict for the main thread to raise (once), or None."""
        if self.found is None or self.raised:
            return None
        self.raised = True
        return self.found

    def leave(self, why: str) -> None:
        """Tells the watchers this rank is leaving (``finished`` or ``failed: ...``)."""
        if self.left or os.getpid() != self.pid:
            return
        self.left = True
        with contextlib.suppress(Exception):
            self.store.set(self._key("left", self.rank), why)

    def stop(self, why: str = "finished") -> None:
        if os.getpid() != self.pid:
            return
        self.leave(why)
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.interval + 1)
        mine = self._signal and signal.getsignal(signal.SIGUSR1) is _on_signal
        if mine and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def _on_signal(signum: int, frame: Any) -> None:
    found = _monitor.take() if _monitor is not None else None
    if found is not None:
        raise DistributedError(found)


def _excepthook(kind: Any, value: Any, tb: Any) -> None:
    if _monitor is not None and not isinstance(value, KeyboardInterrupt):
        _monitor.leave(f"failed: {summary(value, 300)}")
    _previous_hook(kind, value, tb)


_previous_hook = sys.excepthook


def start(
    store: Any, rank: int, world_size: int, interval: float, deadline: float, run: str
) -> None:
    """Starts this rank's heartbeat under the key space ``run`` (the same on every rank)."""
    global _monitor, _previous_hook
    if _monitor is not None or world_size < 2:
        return
    client = store.clone()
    # A store behind a cut network does not answer and does not fail: bound each call, so the
    # thread itself cannot hang past its deadline.
    client.set_timeout(datetime.timedelta(seconds=deadline))
    _monitor = Monitor(client, rank, world_size, interval, deadline, run)
    _monitor.start()
    if sys.excepthook is not _excepthook:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


def stop(why: str = "finished") -> None:
    """Stops this rank's heartbeat, telling the others it left (and why)."""
    global _monitor
    if _monitor is not None:
        _monitor.stop(why)
        _monitor = None


def leave(why: str) -> None:
    """Tells the others this rank is leaving, keeping the heartbeat until :func:`stop`."""
    if _monitor is not None:
        _monitor.leave(why)


def current() -> Monitor | None:
    return _monitor


def verdict(wait: float = 0.0) -> str | None:
    """The detector's verdict, waiting up to ``wait`` seconds for one; marks it raised."""
    m = _monitor
    if m is None:
        return None
    m.raised = True  # whoever asks raises it: the signal handler must not raise it again
    end = time.monotonic() + wait
    while m.found is None and time.monotonic() < end and m._thread.is_alive():
        time.sleep(0.05)
    if m.found is None:
        m.raised = False
    return m.found


atexit.register(stop)
