"""Linear and bilinear layers (``fused``): one GEMM for a shared input, else one ``bmm``.

Linear with a shared input is one GEMM against every member's weights; with per-member
inputs one ``bmm`` whose weight gradient comes out in the stacked weight's own layout
(``backends._bmm``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from phalanx.backends._bmm import linear_bmm, linear_shared
from phalanx.backends.rules._registry import Dims, batch_rule, first, member_first, per_member


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
