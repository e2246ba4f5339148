"""What one vmapped call (``fused``, ``vmap``) needs beyond the member's own forward.

:class:`Guarded` wraps both backends: it refuses where one call's random numbers could not be
each member's own (``_random``: a ``torch.Generator`` passed to the forward, a forward that
reseeds the global generator; a draw from a generator object the member holds or makes is
refused where it is drawn, by ``rules.BatchedOps``), and gives members that hold no
tensors at all (an activation, a parameter-free block) a member axis when every input is
shared: ``vmap`` needs one input to map over, and each member then sees the shared input as
it is (a broadcast view, its own shape and strides).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from phalanx import _torch_compat as compat
from phalanx.backends import BackendRefusal

if TYPE_CHECKING:
    from phalanx.backends import Backend, StackView


def random_refusal(who: str, why: str) -> BackendRefusal:
    """The refusal of ``who`` (a backend, or the vmapped ones), which cannot give each member
    its own random numbers because ``why``; ``auto`` reads ``why`` when it hands over."""
    refusal = BackendRefusal(
        f"Stack.forward(): {who} cannot give each member its own random numbers: {why}.\n"
        f"Use phalanx.stack(models, backend='loop'), or backend='auto', which hands over to "
        f"the loop by itself."
    )
    refusal.why = why  # type: ignore[attr-defined]
    return refusal


class Guarded:
    """A vmapped backend, refusing where its draws could not be each member's own, and with
    a member axis for members that hold no tensors."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name

    def forward(
        self,
        view: StackView,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: tuple[int | None, ...],
        kw_dims: frozenset[str] = frozenset(),
    ) -> Any:
        # A member's own torch.Generator (held, or made in the forward) is refused where it
        # is drawn from (``rules.BatchedOps``): one it holds and never draws from costs
        # nothing.
        if any(isinstance(a, torch.Generator) for a in (*args, *kwargs.values())):
            raise random_refusal(
                f"backend {self.name!r}",
                "a torch.Generator is passed to the forward, and one vmapped call draws every "
                "member's noise from it at once; the loop draws member after member, as the "
                "members alone do",
            )
        if not kw_dims and all(d is None for d in in_dims) and _holds_nothing(view):
            # Nothing to map over: every input shared, no parameter or buffer. Each member
            # sees the shared input through a broadcast view, as it is.
            n = view.num_members
            args = tuple(a.expand(n, *a.shape) if isinstance(a, torch.Tensor) else a for a in args)
            in_dims = tuple(0 if isinstance(a, torch.Tensor) else None for a in args)
        if torch.compiler.is_compiling():
            return self.inner.forward(view, args, kwargs, in_dims, kw_dims)
        before = compat.seed_token()
        out = self.inner.forward(view, args, kwargs, in_dims, kw_dims)
        if compat.seed_token() != before:
            raise random_refusal(
                f"backend {self.name!r}",
                "the member's forward reseeds the global generator (torch.manual_seed): each "
                "member alone then draws what the seed gives, one vmapped call N different "
                "draws",
            )
        return out


def _holds_nothing(view: StackView) -> bool:
    cache = view.cache_of("guard")
    if "empty" not in cache:
        params, buffers = view.state()
        cache["empty"] = not params and not buffers
    return bool(cache["empty"])
