"""Warnings for two inputs that run, but rarely mean what their writer meant.

Both come from scientific-ML code, where the stack is called by a solver or differentiated
against its input:

- **An output fed back as a shared input.** ``odeint(stack, y0, t)`` hands the stack's
  output ``(N, B, d)`` back to it as the next state; without ``in_dims=0`` it is a shared
  input, so every member sees all N states and the output gains a member axis per call
  (``(N, B, d)`` -> ``(N, N, B, d)`` -> ...), until memory runs out. Warned when a shared input
  has N as its first size and the very shape of an output of the stack's previous call: an
  ordinary batch of N samples has the shape of an *input*, not of a stacked output.
- **A shared input that requires grad.** ``torch.autograd.grad(u.sum(), x)`` with a shared
  leaf ``x`` gives the sum of the N members' derivatives (every member's output depends on
  the one ``x``), not each member's own ``u_x``, as a PINN needs. Warned for leaves only: a
  shared input computed by a trainable module upstream (an encoder feeding N heads) should
  get the summed gradient.

A third comes from everyday training code:

- **A per-member batch passed as shared.** ``stack(xs)`` with ``xs`` of shape ``(N, B, d)``,
  meant as member i's batch ``xs[i]``, runs without ``in_dims=0``: every member sees all N
  batches and the output is ``(N, N, B, out)``. Warned when a shared input's first size is N
  and it has one dimension more than what a member was given in this stack's earlier calls
  (shared inputs as they are, per-member inputs without their member axis); before any such
  call, one more than a batch for the member's first layer (4 for a Conv2d, 3 for a
  recurrence, 2 for an embedding's ids; 2, ``(B, d)``, for a Linear or anything else). A
  shared batch whose size happens to be N is warned only where it has that extra dimension
  (a first call with a shared ``(N, T, d)`` sequence batch into a Linear): the message says
  so, and :class:`SharedInputWarning` is the class to filter.

Each warning is given once per stack.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx._torch_compat import pytree
from phalanx._warnings import HintWarning, SharedInputWarning, warn
from phalanx.backends import StackView

_KEY = "habits"


def check_inputs(view: StackView, args: tuple[Any, ...], in_dims: tuple[int | None, ...]) -> None:
    """Warns (once per stack) about a fed-back output, a per-member batch passed as shared or
    a shared input requiring grad; learns the rank of what a member is given at each position
    from the first call that shows it (later calls read it, never write it)."""
    n = view.num_members
    ranks: dict[int, int] | None = None
    for k, (a, d) in enumerate(zip(args, in_dims)):
        if not isinstance(a, torch.Tensor):
            continue
        if d is not None or a.dim() == 0 or a.shape[0] != n:
            if ranks is None:
                ranks = view.cache_of(_KEY).setdefault("ranks", {})
            if k not in ranks:  # learned once per position, as record_ranks does
                ranks[k] = a.dim() - (d is not None)  # what one member sees
        if d is not None:
            continue
        if not a.requires_grad and (a.dim() == 0 or a.shape[0] != n):
            continue  # no check can apply: the common shared input costs no more lookup
        state = view.cache_of(_KEY)
        fed_back = a.dim() > 0 and a.shape[0] == n and a.shape in state.get("outputs", ())
        if fed_back and not state.get("fed_back"):
            state["fed_back"] = True
            warn(
                f"Stack.forward(): input {k} is shared by every member but has the shape of "
                f"an output of this stack, {tuple(a.shape)}, members first: an output fed "
                f"back (an ODE solver's state, a recurrent state) is seen whole by every "
                f"member, and each call adds a member axis. Pass it per member: "
                f"stack(..., in_dims=0) (for a solver, wrap the stack: "
                f"lambda t, y: stack(t, y, in_dims=(None, 0))).",
                SharedInputWarning,
            )
        elif not fed_back and a.dim() > 0 and a.shape[0] == n and not state.get("per_member"):
            _per_member_batch(state, k, a, n, view.template)
        if a.requires_grad and a.is_leaf and torch.is_grad_enabled() and not state.get("grad"):
            state["grad"] = True
            warn(
                f"Stack.forward(): input {k} is shared by every member and requires grad: "
                f"torch.autograd.grad(out.sum(), x) then gives the sum of the {n} members' "
                f"derivatives, not each member's own. For per-member derivatives (a PINN's "
                f"u_x) pass x.expand({n}, *x.shape) with in_dims=0 and differentiate against "
                f"that; if the sum is what you want (e.g. one attack on the whole ensemble), "
                f"ignore this warning.",
                HintWarning,
            )


def _batched_rank(template: nn.Module) -> int | None:
    """The rank of a batch for the member's first leaf module, where its type says it: 4 for
    a Conv2d's ``(B, C, H, W)``, 3 for a batch-first recurrence or attention ``(B, T, d)``, 2
    for an embedding's ids ``(B, T)``; None (read as 2, ``(B, d)``) otherwise."""
    first = next((m for m in template.modules() if not list(m.children())), None)
    for kinds, rank in _BATCHED_RANKS:
        if isinstance(first, kinds):
            return rank
    return None


_BATCHED_RANKS: list[tuple[type[nn.Module] | tuple[type[nn.Module], ...], int]] = [
    ((nn.Conv1d, nn.ConvTranspose1d, nn.MaxPool1d, nn.AvgPool1d), 3),
    ((nn.Conv2d, nn.ConvTranspose2d, nn.MaxPool2d, nn.AvgPool2d, nn.BatchNorm2d), 4),
    ((nn.Conv3d, nn.ConvTranspose3d, nn.MaxPool3d, nn.AvgPool3d, nn.BatchNorm3d), 5),
    ((nn.RNNBase, nn.MultiheadAttention, nn.TransformerEncoderLayer), 3),
    ((nn.Embedding, nn.EmbeddingBag), 2),
]


def _per_member_batch(
    state: dict[str, Any], k: int, a: torch.Tensor, n: int, template: nn.Module
) -> None:
    """Warns where the shared input ``a`` (first size N) has one dimension more than what a
    member was given before at position ``k`` or, with no such call yet, one more than a
    batch for the member's first layer (``_batched_rank``)."""
    member_rank = state.get("ranks", {}).get(k)
    if member_rank is None:
        batched = _batched_rank(template) if k == 0 else None
        if a.dim() != (batched or 2) + 1:
            return
        why = f"has {a.dim()} dimensions, one more than a batch for the member's first layer"
    elif a.dim() == member_rank + 1:
        why = (
            f"has one dimension more than a member was given in this stack's earlier calls "
            f"({member_rank})"
        )
    else:
        return
    state["per_member"] = True
    where = "" if k == 0 else f" (input {k})"
    warn(
        f"Stack.forward(): the input{where} of shape {tuple(a.shape)} is shared by every "
        f"member (in_dims=None), but its first size is {n}, the number of members, and it "
        f"{why}. If it is a per-member batch, member i meant to see x[i], pass "
        f"stack(x, in_dims=0): as called, every member sees all {n} and the output gets "
        f"a second member axis, (N, N, ...). If it is one batch shared by every member whose "
        f"size happens to be {n}, ignore this: it is given once per stack, and "
        f'warnings.filterwarnings("ignore", category=phalanx.SharedInputWarning) silences it.',
        SharedInputWarning,
    )


def record_ranks(view: StackView, args: tuple[Any, ...]) -> None:
    """On the shared fast path: keeps the rank of each shared input, the first time only (a
    dictionary lookup per call)."""
    state = view.cache_of(_KEY)
    if "ranks" not in state:
        state["ranks"] = {k: a.dim() for k, a in enumerate(args) if isinstance(a, torch.Tensor)}


def record_outputs(view: StackView, out: Any) -> Any:
    """Keeps the shapes of this call's tensor outputs for :func:`check_inputs`; returns ``out``."""
    if isinstance(out, torch.Tensor):
        shapes: tuple[torch.Size, ...] = (out.shape,)
    else:
        shapes = tuple(t.shape for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    view.cache_of(_KEY)["outputs"] = shapes
    return out
