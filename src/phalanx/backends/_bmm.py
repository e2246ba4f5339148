"""A batched linear layer whose gradients come out in the stacked weight's own layout.

``baddbmm(b, x, w.transpose(1, 2))`` is the obvious batched ``F.linear``, but autograd
differentiates it through the transpose: the weight's gradient is computed as
``x^T @ g`` of shape ``(N, in, out)`` and handed over transposed, so ``AccumulateGrad``
(whose layout contract wants the gradient strided like the weight) copies it, and the GEMM
itself reads a transposed ``x``. On a 2-core CPU that copy and the slower GEMM cost more
than the forward (simple_mlp of the PyTorch ensembling tutorial, N = 16: 8 ms of a 16 ms
step). Here the backward computes ``g^T @ x`` directly, ``(N, out, in)`` contiguous, which
``AccumulateGrad`` takes as is, as ``F.linear``'s own backward does for one member.

The backward is written with differentiable operations, so second derivatives (gradient
penalties, Hessian-vector products) flow through it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def linear_ops(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x (N, B, in)``, ``w (N, out, in)``, ``b (N, out) | None`` -> ``(N, B, out)``, with
    plain operations (autograd differentiates them through the transpose)."""
    if b is None:
        return torch.bmm(x, w.transpose(1, 2))
    return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))


def linear_shared(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A shared input ``x (*, in)`` against every member's ``w (N, out, in)``, ``b (N, out)``:
    one GEMM against the weights concatenated along the output dimension, ``(*, N, out)``."""
    n, out_f, in_f = w.shape
    y = F.linear(x, w.reshape(n * out_f, in_f), None if b is None else b.reshape(-1))
    return y.unflatten(-1, (n, out_f))


class _LinearBmm(torch.autograd.Function):
    """:func:`linear_ops` with a backward that lays the weight gradient out like the weight.

    Its forward, backward and jvp are plain torch operations, so torch.func batches it by
    itself (``generate_vmap_rule``) under a ``vmap`` of the user's around the stack.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return linear_ops(x, w, b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, w, b = inputs
        ctx.save_for_backward(x, w)
        ctx.save_for_forward(x, w)
        ctx.has_bias = b is not None

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        gx = torch.bmm(g, w) if need_x else None
        gw = torch.bmm(g.transpose(1, 2), x) if need_w else None
        gb = g.sum(1) if ctx.has_bias and need_b else None
        return gx, gw, gb

    @staticmethod
    def jvp(ctx: Any, tx: torch.Tensor | None, tw: torch.Tensor | None, tb: Any) -> torch.Tensor:
        x, w = ctx.saved_tensors
        out = torch.zeros(x.shape[0], x.shape[1], w.shape[1], dtype=x.dtype, device=x.device)
        if tx is not None:
            out = out + torch.bmm(tx, w.transpose(1, 2))
        if tw is not None:
            out = out + torch.bmm(x, tw.transpose(1, 2))
        if tb is not None:
            out = out + tb.unsqueeze(1)
        return out


def linear_bmm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Every member's ``F.linear`` at once: ``(N, B, in)`` -> ``(N, B, out)``.

    Under autocast the plain operations run instead, so that autocast casts them as it casts
    ``F.linear`` (an autograd.Function would need its own casting rules); so they do under
    ``torch.export``, whose graph holds operations, not a Python Function.
    """
    if torch.is_autocast_enabled(x.device.type) or torch.compiler.is_exporting():
        return linear_ops(x, w, b)
    return _LinearBmm.apply(x, w, b)
