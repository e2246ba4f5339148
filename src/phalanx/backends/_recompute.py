"""Activation checkpointing (``torch.utils.checkpoint``) inside a member's forward.

A checkpointed region runs its function a second time during backward, when the autograd
engine needs the activations it did not keep. phalanx puts a member's tensors into the
stack's one module only for the duration of a call (``functional_call`` in the loop,
``torch.func.vmap`` in the others), so that second run, started later by the engine, would
find the stacked ``(N, *shape)`` tensors in the module (torch says ``t() expects a tensor
with <= 2 dimensions`` at backward). Both checkpoint variants are seen where they save their
inputs (a saved-tensor hook around the member's forward, the one place a checkpoint shows
itself at forward time):

- the loop wraps each region's recomputation so that it runs with member i's tensors and
  attributes in place again: exact against the member alone, reentrant or not;
- under ``torch.func.vmap`` the recomputation would have to run inside a vmap that has
  already returned, so the vmap backends refuse at forward time, before anything is kept,
  and ``auto`` hands the call over to the loop.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from phalanx import _torch_compat as compat
from phalanx._torch_compat import pytree

_WRAPPED = "_phalanx_member"


def _identity(x: Any) -> Any:
    return x


@contextlib.contextmanager
def seen(on_checkpoint: Callable[[str, Any], None]) -> Iterator[None]:
    """Calls ``on_checkpoint(kind, frame)`` whenever a checkpoint saves its inputs inside.

    ``kind`` is "frame" (non-reentrant; ``frame`` is torch's ``_CheckpointFrame``) or
    "reentrant" (``frame`` is None: its node is found after the forward). Without grad a
    checkpoint keeps nothing and recomputes nothing, so no hook is installed; nor inside a
    ``torch.func`` transform of the user's (``jacrev`` refuses saved-tensor hooks), where a
    checkpoint is torch.func's to handle.
    """
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or compat.transforms_active():
        yield
        return

    def pack(x: torch.Tensor) -> torch.Tensor:
        site = compat.checkpoint_site(sys._getframe(1))
        if site is not None:
            on_checkpoint(*site)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
        yield


class MemberRecompute:
    """The loop's side: each checkpoint opened by member i recomputes as member i.

    Use :meth:`run` around member i's call; non-reentrant regions are wrapped where they
    save their inputs, reentrant ones (torch keeps them in the autograd node) in the node,
    found in the member's graph after its forward, between its outputs and its inputs.
    """

    def __init__(self, module: torch.nn.Module, attributes: Any, rates: Any = None) -> None:
        self.module = module
        self.attributes = attributes
        self.rates = rates  # the members' dropout rates (``_rates.MemberRates``), or None

    def _as_member(self, i: int, state: dict[str, torch.Tensor], fn: Callable) -> Callable:
        if getattr(fn, _WRAPPED, None) is not None:
            return fn
        module, attributes, rates = self.module, self.attributes, self.rates

        def again(*args: Any, **kwargs: Any) -> Any:
            def call() -> Any:
                with compat.reparametrized(module, state):
                    return (
                        fn(*args, **kwargs)
                        if rates is None
                        else rates.run(i, lambda: fn(*args, **kwargs))
                    )

            return attributes.run(i, module, call)

        setattr(again, _WRAPPED, i)
        return again

    def run(self, i: int, state: dict[str, torch.Tensor], inputs: Any, call: Callable) -> Any:
        reentrant = []

        def on_checkpoint(kind: str, frame: Any) -> None:
            if kind == "frame":
                frame.recompute_fn = self._as_member(i, state, frame.recompute_fn)
            else:
                reentrant.append(True)

        with seen(on_checkpoint):
            out = call()
        if reentrant:
            for node in _nodes_between(out, inputs):
                if type(node).__name__ == "CheckpointFunctionBackward":
                    node.run_function = self._as_member(i, state, node.run_function)
        return out


def _nodes_between(outputs: Any, inputs: Any) -> Iterator[Any]:
    """The autograd nodes reachable from ``outputs`` without passing the inputs' own nodes."""
    stop = {
        id(t.grad_fn)
        for t in pytree.tree_leaves(inputs)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    }
    todo = [
        t.grad_fn
        for t in pytree.tree_leaves(outputs)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    done: set[int] = set()
    while todo:
        node = todo.pop()
        if id(node) in done or id(node) in stop:
            continue
        done.add(id(node))
        yield node
        todo.extend(n for n, _ in node.next_functions if n is not None)


class CheckpointUnderVmap(RuntimeError):
    """Raised where a checkpoint saves its inputs inside the vmapped forward."""


def refuse_under_vmap(kind: str, frame: Any) -> None:
    raise CheckpointUnderVmap(WHY_VMAP)


WHY_VMAP = (
    "the member's forward uses activation checkpointing (torch.utils.checkpoint, or a "
    "model's gradient_checkpointing_enable()), whose recomputation runs during backward, "
    "after the vmapped call has returned, where the member's own tensors are no longer in "
    "place; the loop recomputes each member as itself"
)


def is_checkpoint_failure(e: BaseException) -> bool:
    """True when ``e`` was raised inside ``torch.utils.checkpoint`` (reentrant under vmap:
    its ``autograd.Function`` has no vmap rule) or by :func:`refuse_under_vmap`."""
    if isinstance(e, CheckpointUnderVmap):
        return True
    if "autograd.Function with functorch transforms" not in str(e):
        return False
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith("checkpoint.py") and "torch" in (
            tb.tb_frame.f_code.co_filename
        ):
            return True
        tb = tb.tb_next
    return False
