"""``auto``: the fused backend, or the loop where fused refuses; never a trial run.

Both backends are exact by construction, so nothing needs to be timed or compared: ``auto``
runs ``fused`` on the real call, and only if that fails does the loop run the same call. The
call then runs once more, so what the failed attempt did is undone first: the parameters, the
buffers and the inputs where the attempt wrote into them (on the first call they are saved
beforehand; later, where something was written that cannot be put back, ``auto`` raises
instead of running the member twice). The global random streams are put back too (the CPU
generator and the CUDA one of the stack's devices, saved before each attempt): the loop draws
what it would have drawn had it run alone, as DESIGN asks of every RNG the user can see. The
global stream is the process's, not the call's: where another thread is at work (not waiting
on a lock, queue or selector) it may have drawn meanwhile, and putting the stream back would
replay its numbers; there the attempt's draws are spent and the hand-over's warning says so.
The loop's own error is the member's error and is raised as is; otherwise fused is dropped,
with one warning naming the reason and the backend ``auto`` runs instead, for the context it
failed in (grad mode, and whether a ``torch.func`` transform is around the stack: a refusal
under the user's ``vmap(jacrev(...))`` does not cost ordinary training calls their fast path).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

from phalanx import _torch_compat as compat
from phalanx._errors import summary
from phalanx._torch_compat import pytree
from phalanx._warnings import FallbackWarning, warn
from phalanx.backends import StackView, get_backend


def _reason(e: BaseException) -> str:
    why = getattr(e, "why", None)
    if why is not None:  # a refusal says its reason apart from its advice
        return str(why)
    return summary(e)


SNAPSHOT_BYTES = 8 << 20
"""Buffers and inputs up to this size are saved before each call whose input shapes fused has
not run yet in this context, larger ones on the first call only."""
PARAMETER_SNAPSHOT_BYTES = 256 << 20
"""The parameters are saved before the first call when they total at most this size."""


class _Undo:
    """What an attempt by the fused backend may change, saved so that it can be undone.

    Writes inside ``torch.func.vmap`` do not always move a tensor's version counter (a
    BatchNorm's running statistics, updated by a batching rule, do not), so what may be
    written is saved outright: the buffers and the inputs, on the first call whatever their
    size, on later calls when they total at most ``SNAPSHOT_BYTES``. The parameters (a
    forward that clips or renormalises its own weights in place) are saved on the first call
    when they total at most ``PARAMETER_SNAPSHOT_BYTES``; otherwise their version counters say
    whether the attempt wrote them (an in-place write of a parameter under vmap moves its
    counter), and ``auto`` raises rather than run such a write twice.
    """

    def __init__(
        self, view: StackView, args: tuple, kwargs: dict, first: bool, seen: bool = False
    ) -> None:
        params, buffers = view.state()
        if not kwargs and all(type(a) is torch.Tensor for a in args):
            inputs = list(args)  # the common call: no structure to walk
        else:
            inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.tensors = [*buffers.values(), *inputs]
        size = sum(t.numel() * t.element_size() for t in self.tensors)
        self.saved: list[torch.Tensor] | None = None
        self.params = list(params.items())
        self.saved_params: list[torch.Tensor] | None = None
        self.versions = [compat.version(p) for _, p in self.params]
        # what says, without a copy, whether an unsaved buffer or input was written
        self.tensor_versions = [compat.version(t) for t in self.tensors]
        # Once fused has run calls of these shapes in this context (``seen``), nothing is
        # saved: a copy of every buffer and input on every call is a kernel launch each on a
        # GPU, for a failure that shapes alone no longer predict.
        if first or (size <= SNAPSHOT_BYTES and not seen):
            self.saved = [t.detach().clone() for t in self.tensors]
        if first:
            weights = sum(p.numel() * p.element_size() for _, p in self.params)
            if weights <= PARAMETER_SNAPSHOT_BYTES:
                self.saved_params = [p.detach().clone() for _, p in self.params]

    def undo(self, failure: BaseException) -> None:
        written = [
            name for (name, p), v in zip(self.params, self.versions) if compat.version(p) != v
        ]
        if written and self.saved_params is None:
            raise RuntimeError(
                f"Stack.forward(): backend 'auto' cannot hand this call over to the loop: "
                f"backend 'fused' failed ({_reason(failure)}) after the member's forward wrote "
                f"into its parameter {written[0]!r} in place, which was not saved on this "
                f"call (parameters are saved on the first call, up to "
                f"{PARAMETER_SNAPSHOT_BYTES >> 20} MB). Nothing else ran. Pass "
                f"backend='loop' to phalanx.stack() for this model."
            ) from failure
        if self.saved_params is not None:
            with torch.no_grad():
                for (_, p), saved in zip(self.params, self.saved_params or []):
                    if not torch.equal(p, saved):
                        p.copy_(saved)
        if self.saved is None and any(
            compat.version(t) != v for t, v in zip(self.tensors, self.tensor_versions)
        ):
            raise RuntimeError(
                f"Stack.forward(): backend 'auto' cannot hand this call over to the loop: "
                f"backend 'fused' failed ({_reason(failure)}) after the member's forward "
                f"wrote into its buffers or inputs, which were not saved on this call "
                f"(they are saved on the first call, and on calls of input shapes fused has "
                f"not run yet when they total at most {SNAPSHOT_BYTES >> 20} MB). Nothing else "
                f"ran. Pass backend='loop' to phalanx.stack() for this model."
            ) from failure
        if self.saved is None:
            return  # nothing was written: nothing to put back
        with torch.no_grad():
            for t, saved in zip(self.tensors, self.saved):
                if not torch.equal(t, saved):
                    t.copy_(saved)


def _shapes(
    context: tuple[bool, bool], training: bool, args: tuple, kwargs: dict, in_dims: tuple
) -> Any:
    """The key of the calls that need no snapshot once fused ran one: the context, the
    stack's train/eval mode, the input dims and each input's shape, dtype and device; None (always saved) for any call
    but the common one of plain tensors without keywords."""
    if kwargs or not all(type(a) is torch.Tensor for a in args):
        return None
    return (context, training, in_dims, *((a.shape, a.dtype, a.device) for a in args))


def _rng_state(view: StackView) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """The global generators' states: the CPU one, and the CUDA one of each device the
    stack's tensors are on (about a microsecond each)."""
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        params, buffers = view.state()
        devices = {t.device.index for t in (*params.values(), *buffers.values()) if t.is_cuda}
        cuda = [(d, torch.cuda.get_rng_state(d)) for d in sorted(devices)]
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]) -> None:
    torch.set_rng_state(state[0])
    for device, cuda in state[1]:
        torch.cuda.set_rng_state(cuda, device)


_WAITING = ("threading.py", "queue.py", "selectors.py", "thread.py", "connection.py")
"""Where a thread waits (a lock, a queue, a selector, an executor's idle worker)."""


def _alone() -> bool:
    """Whether no other thread is running Python code that could draw from the global
    stream: every other thread is waiting (a progress bar's monitor, an idle executor's
    workers, a notebook's kernel threads), its innermost frame in the standard library's
    waiting code. A thread inside a C call holding no frame of ours may still run: this is
    the best a library can see, and where it sees another thread at work it says so."""
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident != me and not frame.f_code.co_filename.endswith(_WAITING):
            return False
    return True


class AutoBackend:
    name = "auto"

    def state(self, view: StackView) -> dict[str, Any]:
        cache = view.cache_of("auto")
        if "dropped" not in cache:
            cache.setdefault("settled", False)
            cache.setdefault("dropped", {})
        return cache

    @staticmethod
    def _context() -> tuple[bool, bool]:
        return torch.is_grad_enabled(), compat.transforms_active() or compat.forward_ad_active()

    def current(self, view: StackView) -> str:
        """The backend ``auto`` runs now: "fused", or "loop" where fused refused."""
        return "loop" if self._context() in self.state(view)["dropped"] else "fused"

    def forward(
        self,
        view: StackView,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: tuple[int | None, ...],
        kw_dims: frozenset[str] = frozenset(),
    ) -> Any:
        state = self.state(view)
        context = self._context()
        if context in state["dropped"]:
            return get_backend("loop").forward(view, args, kwargs, in_dims, kw_dims)
        if torch.compiler.is_compiling():
            return get_backend("fused").forward(view, args, kwargs, in_dims, kw_dims)
        shapes = _shapes(context, view.module.training, args, kwargs, in_dims)
        seen = state.setdefault("ran", set())
        undo = _Undo(view, args, kwargs, first=not state["settled"], seen=shapes in seen)
        rng = _rng_state(view)
        try:
            out = get_backend("fused").forward(view, args, kwargs, in_dims, kw_dims)
        except Exception as e:
            undo.undo(e)
            put_back = _alone()
            if put_back:
                _set_rng_state(rng)
            failure = e
        else:
            state["settled"] = True
            if shapes is not None and len(seen) < 64:
                seen.add(shapes)
            return out
        # Outside the except block: the loop's error is the member's own and is raised as
        # such, not as one that happened while handling fused's.
        out = get_backend("loop").forward(view, args, kwargs, in_dims, kw_dims)
        self._drop(state, context, _reason(failure), put_back)
        return out

    @staticmethod
    def _drop(
        state: dict[str, Any], context: tuple[bool, bool], reason: str, put_back: bool = True
    ) -> None:
        if state["dropped"].setdefault(context, reason) is not reason:
            return  # another thread dropped it first (setdefault is atomic) and said so
        grad, transformed = context
        where = "with grad enabled" if grad else "under torch.no_grad"
        if transformed:
            where += " inside a torch.func transform or forward-mode AD"
        warn(
            f"phalanx: backend 'fused' cannot run this model exactly ({reason}); backend "
            f"'auto' runs 'loop' instead {where}. Pass backend='loop' to phalanx.stack() to "
            f"choose it directly and silence this warning."
            + (
                ""
                if put_back
                else " Another thread was running, so the global random stream was not put "
                "back: the refused attempt's draws are spent (putting it back could replay "
                "another thread's draws)."
            ),
            FallbackWarning,
        )


BACKEND = AutoBackend()
