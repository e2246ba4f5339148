"""BatchNorm (both vmap backends): every member's channels in one call whose arithmetic for a
member does not depend on how many members there are.

One call over ``(B, N * C)`` channels, torch.func's layout, rounds a member's channels
differently depending on where they fall: the CPU kernel vectorises a 2-D input across its
channels, and the channels past the last full vector (which ones depends on N) take a scalar
tail that rounds differently. Here each channel of each member is one contiguous run,
``(1, N * C, B * S)`` (S: the spatial size), which the kernel reduces and normalises channel
by channel: the same arithmetic for member i whatever N is, so a member kept in a smaller
stack (successive halving, PBT) continues bit for bit.

Members whose input is large (at least ``ALONE_BYTES`` each, laid out as they are alone) run
member by member instead: each call is the member's own, on a view of its own input, so
there is no ``(1, N * C, B * S)`` copy. One batched call keeps four activation-sized tensors
alive at once forward (the input, that copy, the output and its member-first copy) and four
backward (the saved copy, the gradient's copy, the kernel's gradient and its scratch); member
by member, three and three, and each member's bits are the loop's (the one call's are the
loop's to float rounding). W7 of DESIGN.md (16 CNNs, batch 64): its training step adds less to
the resident set at its peak, and takes less time (benchmarks/notes/BENCHMARKS.md, "Peak memory of a
training step"). Small members keep the one call: one kernel launch instead of N.

GroupNorm (``fused`` only): torch.func's rule is one call over ``(N * B, C)`` without the
affine, then the members' weights and biases applied by separate ops. Here every member's
channels are one ``(B, N * C)`` input with ``N * num_groups`` groups, the weight and bias
applied in the kernel as for the member alone.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from phalanx import _torch_compat as compat
from phalanx.backends.rules._registry import Dims, batch_rule, first, member_first, per_member

_BN_NAMES = (
    "input",
    "running_mean",
    "running_var",
    "weight",
    "bias",
    "training",
    "momentum",
    "eps",
)
_BN_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}

ALONE_BYTES = 1 << 18
"""A member's CPU input of at least this many bytes is normalised by a call of its own."""
ALONE_BYTES_ELSEWHERE = 64 << 20
"""... and on another device (a GPU): there each member's call is a kernel launch, so the one
call is kept up to large members, whose copies the per-member calls spare. A choice made
without a GPU to measure it: unmeasured."""


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose gradient is made contiguous: the kernel's backward then gets the
    same layout whatever N is (for one member the gradient that reaches it is a strided
    view, which it reduces in another order)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t


@batch_rule(F.batch_norm, _BN_NAMES, _BN_DEFAULTS, table="correctness")
def _batch_norm(
    n: int,
    dims: Dims,
    x: Any,
    mean: Any,
    var: Any,
    w: Any,
    b: Any,
    training: Any,
    momentum: Any,
    eps: Any,
) -> Any:
    xs = first(x, dims[0], n)  # (N, B, C, *sp)
    stats = [first(t, d, n) for t, d in zip((mean, var), dims[1:3])]  # (N, C) | None
    written = training and any(t is not None for t in stats)
    if (
        xs.dim() < 3
        # running statistics shared by the members are updated by each in turn
        or (written and any(t is not None and d is None for t, d in zip((mean, var), dims[1:3])))
        # they are updated in place through a flat view of them
        or (written and any(t is not None and not t.is_contiguous() for t in stats))
    ):
        return per_member(n, dims, F.batch_norm, x, mean, var, w, b, training, momentum, eps)
    if (
        dims[0] == 0
        and not compat.tracing()
        and xs[0].is_contiguous()
        and xs[0].nbytes >= (ALONE_BYTES if xs.device.type == "cpu" else ALONE_BYTES_ELSEWHERE)
    ):
        # each member's input, a contiguous view, as it is alone: its own call, no copy (not
        # under a trace: a symbolic size has no value to compare)
        return per_member(n, dims, F.batch_norm, x, mean, var, w, b, training, momentum, eps)
    batch, c, sp = xs.shape[1], xs.shape[2], xs.shape[3:]
    # contiguous whatever N is (for one member the reshape alone is a strided view, which the
    # kernel reduces in another order)
    channels = xs.movedim(2, 1).reshape(1, n * c, batch * math.prod(sp)).contiguous()

    def flat(t: Any, d: Any) -> Any:
        return None if t is None else first(t, d, n).reshape(n * c)

    y = F.batch_norm(
        channels,
        flat(mean, dims[1]),
        flat(var, dims[2]),
        flat(w, dims[3]),
        flat(b, dims[4]),
        training,
        momentum,
        eps,
    )
    y = _ContiguousGrad.apply(y)
    return member_first(y.view(n, c, batch, *sp).movedim(1, 2), 0, n), 0


_GN_NAMES = ("input", "num_groups", "weight", "bias", "eps")
_GN_DEFAULTS = {"weight": None, "bias": None, "eps": 1e-5}


@batch_rule(F.group_norm, _GN_NAMES, _GN_DEFAULTS, table="speed")
def _group_norm(n: int, dims: Dims, x: Any, num_groups: Any, w: Any, b: Any, eps: Any) -> Any:
    """GroupNorm of every member in one call: member i's C channels become channels
    ``i*C .. (i+1)*C`` of one ``(B, N * C, *sp)`` input with ``N * num_groups`` groups, so each
    group is the member's own group, one contiguous run, normalised and scaled by the
    member's own weight and bias in the kernel (the arithmetic of the member alone)."""
    xs = first(x, dims[0], n)  # (N, B, C, *sp)
    params = [first(t, d, n) for t, d in zip((w, b), dims[2:4])]  # (N, C) | None
    if (
        not isinstance(num_groups, int)
        or num_groups <= 0
        or xs.dim() < 3
        or xs.shape[2] % num_groups != 0  # the member raises its own error
        or xs.shape[1] == 0
        # a member's strided or channels-last input takes another path of the kernel
        or not xs[0].is_contiguous()
        or any(
            p is not None
            and (p.shape[1:] != (xs.shape[2],) or p.dtype != xs.dtype or p.device != xs.device)
            for p in params
        )
    ):
        return per_member(n, dims, F.group_norm, x, num_groups, w, b, eps)
    batch, c, sp = xs.shape[1], xs.shape[2], xs.shape[3:]
    channels = xs.movedim(0, 1).reshape(batch, n * c, *sp).contiguous()
    y = F.group_norm(
        channels,
        n * num_groups,
        None if params[0] is None else params[0].reshape(n * c),
        None if params[1] is None else params[1].reshape(n * c),
        eps,
    )
    y = _ContiguousGrad.apply(y)
    return member_first(y.view(batch, n, c, *sp), 1, n), 0
