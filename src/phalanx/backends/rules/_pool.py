"""Max-pooling (``fused`` only): torch's own kernel run in the channels-last layout.

torch's CPU ``max_pool2d_with_indices`` on a contiguous (NCHW) input runs a scalar loop per
output element; on a channels-last input it runs the same comparisons vectorised across the
channels: on W7 of DESIGN.md's first pool, ``(64, 16, 26, 26)`` per member, 4.4 ms against
0.5 ms (1.7 ms with the copies into and out of that layout), one thread. Both kernels take,
for each output, the first element of the window that is greater than every one before it or
NaN (``val > max || isnan(val)``, scanned row by row), so the values and the indices are the
member's own bit for bit; they come back contiguous, as the member's are (the input is
copied to channels-last and the outputs back in blocks of images, ``BLOCK_BYTES``). The backward is
torch's ``max_pool2d_with_indices_backward`` on those indices, the loop's own formula, and is
itself differentiable as the loop's is (second derivatives).

Taken for all members at once where each member's input is a contiguous floating-point CPU
tensor; otherwise (another layout, a trace, forward-mode AD, ``return_indices=True``, another
transform around the stack) torch.func's own rule runs: the same kernel on the members' inputs
folded into one batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from phalanx import _torch_compat as compat
from phalanx.backends.rules._registry import Dims, batch_rule, first

_POOL_NAMES = (
    "input",
    "kernel_size",
    "stride",
    "padding",
    "dilation",
    "ceil_mode",
    "return_indices",
)
_POOL_DEFAULTS = {
    "stride": None,
    "padding": 0,
    "dilation": 1,
    "ceil_mode": False,
    "return_indices": False,
}


BLOCK_BYTES = 4 << 20
"""The input is pooled in blocks of images of at most this many bytes (at least one image):
each block's channels-last copy and outputs stay in cache on their way back. Measured on W7
(one member's first pool input is 2.8 MB): its fused training step 1.12x the loop's speed in
blocks, 1.07x as one call (interleaved in one process, one thread)."""


class _ChannelsLastMaxPool(torch.autograd.Function):
    """``max_pool2d_with_indices`` of a contiguous ``(B, C, H, W)`` input, computed in the
    channels-last layout, values and indices handed back contiguous."""

    @staticmethod
    def forward(x: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows = max(1, BLOCK_BYTES // max(1, x[0].nbytes))
        values = indices = None
        for r in range(0, x.shape[0], rows):
            cl = x[r : r + rows].contiguous(memory_format=torch.channels_last)
            v, i = torch.ops.aten.max_pool2d_with_indices(cl, *args)
            if values is None or indices is None:
                values = v.new_empty((x.shape[0], *v.shape[1:]))
                indices = i.new_empty(values.shape)
            values[r : r + rows].copy_(v)
            indices[r : r + rows].copy_(i)
        assert values is not None and indices is not None
        return values, indices

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.args = inputs[1:]
        ctx.save_for_backward(inputs[0], output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple:
        x, indices = ctx.saved_tensors
        g = torch.ops.aten.max_pool2d_with_indices_backward(grad, x, *ctx.args, indices)
        return (g, *(None for _ in ctx.args))


def _fast(x: torch.Tensor) -> bool:
    return (
        x.dim() == 4
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.float64)
        and x.is_contiguous()
        and x.numel() > 0
        and not compat.tracing()
        and not compat.is_wrapped(x)  # another transform around the stack
        and not compat.forward_ad_active()
    )


@batch_rule(F.max_pool2d, _POOL_NAMES, _POOL_DEFAULTS, table="speed")
def _max_pool2d(
    n: int,
    dims: Dims,
    x: Any,
    kernel_size: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    ceil_mode: Any,
    return_indices: Any,
) -> Any:
    xs = first(x, dims[0], n)  # (N, B, C, H, W) or (N, C, H, W)
    flat = xs.flatten(0, 1) if xs.dim() == 5 else xs
    stride = [] if stride is None else stride
    if return_indices or not _fast(flat):
        y = F.max_pool2d(flat, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
    else:
        y = _ChannelsLastMaxPool.apply(flat, kernel_size, stride, padding, dilation, ceil_mode)[0]
    if xs.dim() == 5:
        y = tuple(t.unflatten(0, (n, -1)) for t in y) if return_indices else y.unflatten(0, (n, -1))
    return (y, (0, 0)) if return_indices else (y, 0)
