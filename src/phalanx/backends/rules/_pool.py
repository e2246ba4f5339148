"""Max pooling (both vmap backends): the members folded into the batch, and the window indices
recomputed in the backward instead of kept.

``max_pool2d`` with ``return_indices=False`` keeps, for its backward, its input and the int64
index of every window's maximum: twice the bytes of its float32 output, kept for all N
members from the forward to the backward (W7 of DESIGN.md: 27 MiB of the 16 members' 177 MiB
at the peak of a training step). Here the forward keeps only the input (which the ReLU before
it usually keeps already: one tensor) and the backward computes the indices again with the
same kernel on the same input, then calls the same backward kernel as torch: each window's
maximum, its tie-breaking and its gradient are the member's own, bit for bit, and the
pooling is per window, so the members folded into the batch do not change a member's bits.

Inputs laid out otherwise than contiguous (channels-last, a member-first view that does not
fold into the batch), calls returning the indices, calls under an outer ``torch.func``
transform or a trace, and calls without autograd run torch.func's own rule (the same folding,
torch's autograd).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from phalanx import _torch_compat as compat
from phalanx.backends.rules._registry import Dims, batch_rule, first

_NAMES = (
    "input",
    "kernel_size",
    "stride",
    "padding",
    "dilation",
    "ceil_mode",
    "return_indices",
)
_DEFAULTS = {
    "stride": None,
    "padding": 0,
    "dilation": 1,
    "ceil_mode": False,
    "return_indices": False,
}

_KERNELS = {
    2: (torch.ops.aten.max_pool2d_with_indices, torch.ops.aten.max_pool2d_with_indices_backward),
    3: (torch.ops.aten.max_pool3d_with_indices, torch.ops.aten.max_pool3d_with_indices_backward),
}


def _tuple(v: Any, k: int) -> list[int]:
    return [int(v)] * k if isinstance(v, int) else [int(e) for e in v]


class _Recomputed(torch.autograd.Function):
    """``max_poolKd`` keeping its input only: the indices are recomputed in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: int, options: tuple) -> torch.Tensor:
        y, _ = _KERNELS[k][0](x, *options)
        ctx.k, ctx.options = k, options
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        pool, pool_backward = _KERNELS[ctx.k]
        if torch.is_grad_enabled():  # create_graph: torch's own pooling, differentiated
            with torch.enable_grad():
                leaf = x.detach().requires_grad_()
                (gx,) = torch.autograd.grad(pool(leaf, *ctx.options)[0], leaf, g, create_graph=True)
            return gx, None, None
        _, indices = pool(x, *ctx.options)
        return pool_backward(g, x, *ctx.options, indices), None, None


def _pool(spatial: int, func: Any) -> Any:
    def rule(n: int, dims: Dims, x: Any, kernel: Any, stride: Any, *rest: Any) -> Any:
        padding, dilation, ceil_mode, return_indices = rest
        xs = first(x, dims[0], n)  # (N, [B,] C, *spatial)
        batched = xs.dim() == spatial + 3  # each member's input has a batch dim
        folded = xs.flatten(0, 1) if batched else xs
        options = (
            _tuple(kernel, spatial),
            _tuple(kernel if stride is None or stride == [] else stride, spatial),
            _tuple(padding, spatial),
            _tuple(dilation, spatial),
            bool(ceil_mode),
        )
        if (
            return_indices
            or xs.dim() not in (spatial + 2, spatial + 3)
            or not folded.is_contiguous()
            or not folded.is_floating_point()
            or compat.tracing()
            or compat.is_wrapped(folded)  # an outer torch.func transform: torch's own rule
            or not torch.is_grad_enabled()
            or not folded.requires_grad
        ):
            # torch.func's own rule: the members folded into the batch, torch's autograd
            out = func(folded, kernel, stride, padding, dilation, ceil_mode, return_indices)
        else:
            out = _Recomputed.apply(folded, spatial, options)
        if isinstance(out, tuple):
            return tuple(o.unflatten(0, (n, -1)) if batched else o for o in out), (0, 0)
        return (out.unflatten(0, (n, -1)) if batched else out), 0

    return rule


def _register() -> None:
    f: Any
    for k, f in ((2, F.max_pool2d), (3, F.max_pool3d)):
        batch_rule(f, _NAMES, _DEFAULTS, table="correctness")(_pool(k, f))


_register()
