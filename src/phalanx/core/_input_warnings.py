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

Each warning is given once per stack.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx._torch_compat import pytree
from phalanx._warnings import HintWarning, warn
from phalanx.backends import StackView

_KEY = "habits"


def check_inputs(view: StackView, args: tuple[Any, ...], in_dims: tuple[int | None, ...]) -> None:
    """Warns (once per stack) about a fed-back output or a shared input requiring grad."""
    n = view.num_members
    for k, (a, d) in enumerate(zip(args, in_dims)):
        if d is not None or not isinstance(a, torch.Tensor):
            continue
        if not a.requires_grad and (a.dim() == 0 or a.shape[0] != n):
            continue  # neither check can apply: the common shared input costs no lookup
        state = view.cache_of(_KEY)
        if (
            a.dim() > 0
            and a.shape[0] == n
            and a.shape in state.get("outputs", ())
            and not state.get("fed_back")
        ):
            state["fed_back"] = True
            warn(
                f"Stack.forward(): input {k} is shared by every member but has the shape of "
                f"an output of this stack, {tuple(a.shape)}, members first: an output fed "
                f"back (an ODE solver's state, a recurrent state) is seen whole by every "
                f"member, and each call adds a member axis. Pass it per member: "
                f"stack(..., in_dims=0) (for a solver, wrap the stack: "
                f"lambda t, y: stack(t, y, in_dims=(None, 0))).",
                HintWarning,
            )
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


def record_outputs(view: StackView, out: Any) -> Any:
    """Keeps the shapes of this call's tensor outputs for :func:`check_inputs`; returns ``out``."""
    if isinstance(out, torch.Tensor):
        shapes: tuple[torch.Size, ...] = (out.shape,)
    else:
        shapes = tuple(t.shape for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    view.cache_of(_KEY)["outputs"] = shapes
    return out
