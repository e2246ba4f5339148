"""``auto``: the fused backend, or the loop where fused refuses; never a trial run.

Both backends are exact by construction, so nothing needs to be timed or compared: ``auto``
runs ``fused`` on the real call, and only if that fails does the loop run the same call. The
call then runs once more, so what the failed attempt did is undone first: the random streams
are put back, and so are the buffers and the inputs where the attempt wrote into them (on the
first call they are saved beforehand; later, where something was written that cannot be put
back, ``auto`` raises instead of running the member twice). The loop's own error is the
member's error and is raised as is; otherwise fused is dropped, with one warning naming the
reason and the backend ``auto`` runs instead, for the context it failed in (grad mode, and
whether a ``torch.func`` transform is around the stack: a refusal under the user's
``vmap(jacrev(...))`` does not cost ordinary training calls their fast path).
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx import _torch_compat as compat
from phalanx._torch_compat import pytree
from phalanx._warnings import warn
from phalanx.backends import StackView, get_backend


def _reason(e: BaseException) -> str:
    why = getattr(e, "why", None)
    if why is not None:  # a refusal says its reason apart from its advice
        return str(why)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


SNAPSHOT_BYTES = 8 << 20
"""Buffers and inputs up to this size are saved before every call, larger ones on the first."""


class _Undo:
    """What an attempt by the fused backend may change, saved so that it can be undone.

    Writes inside ``torch.func.vmap`` do not always move a tensor's version counter (a
    BatchNorm's running statistics, updated by a batching rule, do not), so what may be
    written is saved outright: the buffers and the inputs, on the first call whatever their
    size, on later calls when they total at most ``SNAPSHOT_BYTES``.
    """

    def __init__(self, view: StackView, args: tuple, kwargs: dict, first: bool) -> None:
        _, buffers = view.state()
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.tensors = [*buffers.values(), *inputs]
        size = sum(t.numel() * t.element_size() for t in self.tensors)
        self.saved: list[torch.Tensor] | None = None
        if first or size <= SNAPSHOT_BYTES:
            with torch.no_grad():
                self.saved = [t.clone() for t in self.tensors]
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []

    def undo(self, failure: BaseException) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.saved is None:
            raise RuntimeError(
                f"Stack.forward(): backend 'auto' cannot hand this call over to the loop: "
                f"backend 'fused' failed ({_reason(failure)}) after the member's forward may "
                f"have written into its buffers or inputs, which are too large to have been "
                f"saved on every call. Nothing else ran. Pass backend='loop' to "
                f"phalanx.stack() for this model."
            ) from failure
        with torch.no_grad():
            for t, saved in zip(self.tensors, self.saved):
                if not torch.equal(t, saved):
                    t.copy_(saved)


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
        undo = _Undo(view, args, kwargs, first=not state["settled"])
        try:
            out = get_backend("fused").forward(view, args, kwargs, in_dims, kw_dims)
        except Exception as e:
            undo.undo(e)
            failure = e
        else:
            state["settled"] = True
            return out
        # Outside the except block: the loop's error is the member's own and is raised as
        # such, not as one that happened while handling fused's.
        out = get_backend("loop").forward(view, args, kwargs, in_dims, kw_dims)
        self._drop(state, context, _reason(failure))
        return out

    @staticmethod
    def _drop(state: dict[str, Any], context: tuple[bool, bool], reason: str) -> None:
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
        )


BACKEND = AutoBackend()
