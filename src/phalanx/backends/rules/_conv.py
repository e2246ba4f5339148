"""Convolutions (both vmap backends): one convolution per member, never a grouped one.

torch.func's rule runs one grouped convolution over ``N * C`` channels, whose weight
gradients come out up to 37,000x further from a float64 loop than the float32 loop is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from phalanx import _torch_compat as compat
from phalanx.backends.rules._registry import (
    BatchRule,
    Dims,
    batch_rule,
    first,
    member_first,
    per_member,
)

_CONV_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
_CONVT_NAMES = (
    "input",
    "weight",
    "bias",
    "stride",
    "padding",
    "output_padding",
    "groups",
    "dilation",
)
_CONVT_DEFAULTS = {
    "bias": None,
    "stride": 1,
    "padding": 0,
    "output_padding": 0,
    "groups": 1,
    "dilation": 1,
}


SIDE_BY_SIDE_MIN_TAPS = 16
"""A shared input runs one convolution with every member's filters side by side where each
output element sums at least this many products (input channels times kernel taps, a
filter's size); below it, one convolution per member. A small filter (one input channel, a
3x3 kernel: 9) makes the convolution write-bound: the side-by-side output ``(B, N * out, ...)``
then costs a copy into the members-first layout and back for its gradient, the size of the
output each way, which the per-member calls (each output the member's own, their gradients
views of the stacked one) do not. W7 of DESIGN.md's first layer (1 -> 16 channels, 3x3, 26x26
outputs, batch 64, 16 members), forward and backward: per member 0.71x the side-by-side time
at one thread, 0.53x at two; simple_cnn's (1 -> 32, 3x3, batch 8) 0.51x / 0.61x; with three
input channels (27 and 75 products: resnet_basicblock's and lenet's) side by side is faster,
1.4x to 2x. On a CPU, outside a trace (a traced or exported graph keeps one convolution
node, and on a GPU each member's call is a kernel launch: unmeasured there)."""


def _small_filters_on_cpu(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the members' filters ``w (N, out, in, *k)`` of a shared CPU input are below
    ``SIDE_BY_SIDE_MIN_TAPS`` products each, outside a trace: one convolution per member."""
    return (
        x.device.type == "cpu"
        and not compat.tracing()
        and math.prod(w.shape[2:]) < SIDE_BY_SIDE_MIN_TAPS
    )


def _conv(func: Callable[..., torch.Tensor], spatial: int, transposed: bool) -> BatchRule:
    def rule(n: int, dims: Dims, x: Any, w: Any, *rest: Any) -> Any:
        if all(d is None for d in dims[1:]):  # shared weights: the batch folds into the input's
            xd = dims[0]
            xs = x.movedim(xd, 0)
            y = func(xs.flatten(0, 1), w, *rest)
            return y.unflatten(0, (n, -1)), 0
        if (
            dims[0] is None
            and not transposed
            and rest[4] == 1
            and dims[1] is not None
            and not _small_filters_on_cpu(x, w.movedim(dims[1], 0))
        ):
            bias, stride, padding, dilation, _ = rest
            # A shared input: one ordinary convolution with every member's filters side by
            # side, each output channel the member's own (not a grouped convolution, whose
            # weight gradients round far from the loop's).
            w = w.movedim(dims[1], 0)  # (N, out, in, *k)
            b = None if bias is None else first(bias, dims[2], n).reshape(-1)
            y = func(x, w.flatten(0, 1), b, stride, padding, dilation, 1)
            at = 1 if x.dim() == spatial + 2 else 0  # (B, N * out, ...) or unbatched
            return member_first(y.unflatten(at, (n, -1)), at, n), 0
        return per_member(n, dims, func, x, w, *rest)

    return rule


def _register() -> None:
    f: Any
    for k, f in enumerate((F.conv1d, F.conv2d, F.conv3d), start=1):
        batch_rule(f, _CONV_NAMES, _CONV_DEFAULTS, table="correctness")(_conv(f, k, False))
    for k, f in enumerate((F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d), start=1):
        batch_rule(f, _CONVT_NAMES, _CONVT_DEFAULTS, table="correctness")(_conv(f, k, True))


_register()
