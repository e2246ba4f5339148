"""``auto``: the fastest backend that runs the stack exactly, chosen stably, said truthfully.

On the first call in each grad mode, ``auto`` tries the backends fastest first. Any failure
of a faster one (a refusal, a missing batching rule, a crash) hands over to the next: the
loop runs the member's code as written and is the specification. The backends that run are
then timed (forward, and backward when training) and the fastest kept, unless a preferred one
(the loop, then fused) is within a margin of it: timing noise must not decide whether a result is bit-identical to
the loop. A backend that fails is dropped for good once a slower one has run the same input,
with one warning that names the backend ``auto`` actually runs.

All of this happens outside ``torch.compile``'s tracing (``torch.compiler.disable``): the
compiled graph only sees the chosen backend's forward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from phalanx._backends import BACKENDS, StackView, get_backend
from phalanx._backends._preserve import preserved, seconds

logger = logging.getLogger("phalanx")

MARGIN = 0.05
"""A faster backend is chosen over a preferred one only when at least this much faster."""
ROUNDS = 5
"""Timed rounds of the race, each backend once per round, interleaved; the best counts."""
# Preferred first: fused, the batched path, whose every case is checked against the loop
# and whose cost grows slowest with N (one kernel per layer, not N); then the loop, the
# specification; then torch.func's vmap, whose batching rules phalanx cannot check (two gave
# silently wrong answers: see _vmap.py). Within the margin the difference is timing noise.
_PREFERENCE = ("fused", "loop", "vmap")


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


class AutoBackend:
    name = "auto"

    def state(self, view: StackView) -> dict[str, Any]:
        cache = view.cache_of("auto")
        cache.setdefault("candidates", list(BACKENDS))
        cache.setdefault("picks", {})
        return cache

    def current(self, view: StackView) -> str:
        """The backend ``auto`` runs now in this grad mode (its best guess before a call)."""
        state = self.state(view)
        return state["picks"].get(torch.is_grad_enabled(), state["candidates"][0])

    def forward(
        self,
        view: StackView,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: tuple[int | None, ...],
    ) -> Any:
        if torch.compiler.is_compiling():
            name = self._choose_outside_graph(view, args, kwargs, in_dims)
            return get_backend(name).forward(view, args, kwargs, in_dims)
        pick = self.state(view)["picks"].get(torch.is_grad_enabled())
        name = pick if pick is not None else self._choose(view, args, kwargs, in_dims)
        try:
            return get_backend(name).forward(view, args, kwargs, in_dims)
        except Exception as e:
            if name == "loop":
                raise
            # A new input the chosen backend cannot run (the fused check failed on it, say):
            # the next backend runs it, and the chosen one is dropped if that one succeeds.
            failed = {name: _reason(e)}
        name = self._choose(view, args, kwargs, in_dims, failed=failed)
        return get_backend(name).forward(view, args, kwargs, in_dims)

    @torch.compiler.disable
    def _choose_outside_graph(self, *args: Any) -> str:
        """The choice, kept out of torch.compile's graph (it times backends)."""
        return self._choose(*args)

    def _choose(
        self,
        view: StackView,
        args: tuple,
        kwargs: dict,
        in_dims: tuple,
        failed: dict[str, str] | None = None,
    ) -> str:
        state = self.state(view)
        mode = torch.is_grad_enabled()
        pick = state["picks"].get(mode)
        if pick is not None and not failed:
            return pick
        failed = dict(failed or {})
        runnable: list[str] = []
        for name in state["candidates"]:
            if name in failed:
                continue
            try:
                with preserved(view):
                    get_backend(name).forward(view, args, kwargs, in_dims)
            except Exception as e:
                if name == "loop":
                    raise  # the member's own code fails: the user's error, nothing to drop
                failed[name] = _reason(e)
                continue
            runnable.append(name)
            if name == "loop":
                break
        if not runnable:
            # Only faster backends were left and every one failed: the loop decides.
            runnable = ["loop"]
        choice = self._race(view, runnable, args, kwargs, in_dims)
        self._drop(state, failed, choice)
        state["picks"] = {m: p for m, p in state["picks"].items() if p not in failed}
        state["picks"][mode] = choice
        logger.info("phalanx: backend 'auto' runs %r when grad mode is %s", choice, mode)
        return choice

    @staticmethod
    def _drop(state: dict[str, Any], failed: dict[str, str], runs: str) -> None:
        """Takes the backends that failed out of the choice for good, in one warning."""
        dropped = {n: r for n, r in failed.items() if n in state["candidates"]}
        if not dropped:
            return
        for name in dropped:
            state["candidates"].remove(name)
        if "loop" not in state["candidates"]:
            state["candidates"].append("loop")
        which = " and ".join(f"backend {n!r} ({r})" for n, r in dropped.items())
        warnings.warn(
            f"phalanx: {which} cannot run this model exactly; backend 'auto' runs {runs!r} "
            f"instead. Pass backend={runs!r} to phalanx.stack() to choose it directly and "
            f"silence this warning.",
            stacklevel=6,
        )

    @staticmethod
    def _race(view: StackView, names: list[str], args: tuple, kwargs: dict, in_dims: tuple) -> str:
        """Times the backends that run this input and returns the one to keep.

        Like cuDNN's benchmark mode: a batched computation is not always faster than a loop
        (large convolutions on a CPU). Under autograd the backward pass is timed too, into
        the parameters' ``.grad`` as a training step does it (a gradient laid out unlike its
        parameter costs ``AccumulateGrad`` a copy, which ``torch.autograd.grad`` would hide:
        vmap's Linear weight gradients do); the ``.grad`` found before is put back after. The
        fastest wins unless a preferred backend is within ``MARGIN`` of it.
        """
        if len(names) < 2:
            return names[0]
        params = [p for p in view.module.parameters() if p.requires_grad]
        train = torch.is_grad_enabled() and bool(params)
        device = params[0].device if params else torch.device("cpu")

        def run(name: str) -> None:
            out = get_backend(name).forward(view, args, kwargs, in_dims)
            if train:
                leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                total = sum(t.float().sum() for t in leaves if t.requires_grad)
                if isinstance(total, torch.Tensor):
                    for p in params:
                        p.grad = None  # as zero_grad(set_to_none=True) leaves them
                    torch.autograd.backward(total, inputs=params)

        times: dict[str, float] = {}
        with preserved(view), _grads_restored(params):
            calls: dict[str, Callable[[], None]] = {}
            for name in names:  # warm-up, and what does not run or is hopeless drops out
                try:
                    call = functools.partial(run, name)
                    first = seconds(call, device, repeats=1)
                except Exception as e:  # it ran once already; a failure here is not a pick
                    logger.debug("phalanx: backend %r left out of the race: %s", name, e)
                    continue
                if not calls or first <= 10 * min(times.values()):
                    calls[name], times[name] = call, first
            # Interleaved rounds: a slow spell of the machine hits every backend alike.
            times = dict.fromkeys(calls, float("inf"))
            for _ in range(ROUNDS):
                for name, timed in list(calls.items()):
                    try:
                        times[name] = min(times[name], seconds(timed, device, repeats=1))
                    except Exception as e:
                        logger.debug("phalanx: backend %r left out of the race: %s", name, e)
                        del calls[name], times[name]
        if not times:
            return names[-1]
        best = min(times.values())
        close = [n for n in _PREFERENCE if n in times and times[n] <= best * (1 + MARGIN)]
        choice = close[0]
        logger.info(
            "phalanx: backend 'auto' timed %s and picked %r",
            ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in times.items()),
            choice,
        )
        return choice


@contextlib.contextmanager
def _grads_restored(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Puts back the ``.grad`` of ``params`` as they were on entry."""
    grads = [p.grad for p in params]
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g


BACKEND = AutoBackend()
