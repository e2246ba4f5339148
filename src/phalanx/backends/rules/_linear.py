"""Linear and bilinear layers (``fused``): one GEMM for a shared input, else one ``bmm``.

Linear with a shared input is one GEMM against every member's weights; with per-member
inputs one ``bmm`` whose weight gradient comes out in the stacked weight's own layout
(``backends._bmm``), except for small weights (:data:`SMALL_WEIGHT`), which torch.func's own
batching of ``F.linear`` runs faster: the rule's ``autograd.Function`` under vmap costs more
there than the weight-gradient copy it saves.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from phalanx import _torch_compat as compat
from phalanx.backends._bmm import linear_bmm, linear_shared
from phalanx.backends.rules._registry import (
    SPEED,
    Dims,
    batch_rule,
    first,
    member_first,
    per_member,
    register,
)


@batch_rule(F.linear, ("input", "weight", "bias"), {"bias": None}, table="speed")
def _linear(n: int, dims: Dims, x: Any, w: Any, b: Any = None) -> Any:
    xd, wd, bd = dims
    if wd is None and bd is None:  # only the input is batched: its batch is one more dim
        return member_first(F.linear(x, w, b), xd, n), 0
    w = first(w, wd, n)  # (N, out, in)
    b = first(b, bd, n)  # (N, out) | None
    out_f, in_f = w.shape[1], w.shape[2]
    if xd is None:  # a shared input: one GEMM against every member's weights, (*, N, out),
        # each member's output then laid out as its own F.linear's
        return member_first(linear_shared(x, w, b), x.dim() - 1, n), 0
    x = x.movedim(xd, 0)
    y = linear_bmm(x.reshape(n, -1, in_f), w, b)
    return y.reshape(*x.shape[:-1], out_f), 0


SMALL_WEIGHT = 1 << 15
"""A member's weight of at most this many elements (128 KiB of float32), with a per-member
input, runs eagerly torch.func's own batching of ``F.linear`` (a ``bmm`` and a bias ``add``; the
weight gradient copied into the weight's layout), not :func:`_linear`. Two Linears and a
ReLU under vmap, forward and backward, 1 thread, interleaved: the rule took 1.13x
torch.func's time on W8's (8 members, (16, 40, 64) -> 128 -> 64), 1.04-1.88x on every shape
tried up to 2^15-element weights (8-64 members), 0.99x at 2^16
(benchmarks/notes/DYNAMIC.md, issue 26's fourth session). torch.func's rule is the ``vmap``
backend's, exact by the same tests; only the speed differs."""

_by_rule = SPEED[F.linear]


def _linear_route(args: tuple, kwargs: dict) -> Any:
    """``F.linear``: torch.func's own batching for a per-member input and a small weight,
    the rule otherwise (a shared input is one GEMM against every member's weights)."""
    x = args[0] if args else kwargs.get("input")
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    if (
        isinstance(x, torch.Tensor)
        and isinstance(w, torch.Tensor)
        and w.numel() <= SMALL_WEIGHT
        and compat.is_wrapped(x)
        and compat.is_wrapped(w)
        # torch.func computes in float32 under CPU autocast (see the vmap backend), and
        # torch.export traces the rule's operations: both keep the rule. So does any trace:
        # the compiled graph of the rule runs faster (compile_step, one process, 16 members: simple_mlp
        # 1.48x the fused-Adam loop with the rule traced, 1.12x with torch.func's; nanogpt
        # 1.44x against 1.20x)
        and not torch.is_autocast_enabled(x.device.type)
        and not torch.compiler.is_exporting()
        and not compat.tracing()
    ):
        return F.linear(*args, **kwargs)  # the mode is off inside its own handler
    return _by_rule(args, kwargs)


register(F.linear, _linear_route, table="speed")


@batch_rule(F.bilinear, ("input1", "input2", "weight", "bias"), {"bias": None}, table="speed")
def _bilinear(n: int, dims: Dims, x1: Any, x2: Any, w: Any, b: Any = None) -> Any:
    if dims[2] is None and dims[3] is None:
        return per_member(n, dims, F.bilinear, x1, x2, w, b)
    a, c = first(x1, dims[0], n), first(x2, dims[1], n)  # (N, *, in1), (N, *, in2)
    w = first(w, dims[2], n)  # (N, out, in1, in2)
    y = torch.einsum("nbi,noij,nbj->nbo", a.reshape(n, -1, a.shape[-1]), w,
                     c.reshape(n, -1, c.shape[-1]))  # fmt: skip
    if b is not None:
        y = y + first(b, dims[3], n).unsqueeze(1)
    return member_first(y.reshape(*a.shape[:-1], w.shape[1]), 0, n), 0
