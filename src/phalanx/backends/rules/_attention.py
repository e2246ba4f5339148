"""Attention (``fused``): scaled dot-product attention and ``nn.MultiheadAttention``.

Attention is per (sample, head) anyway, so the members merge into the first batch dim and
every member's attention is one call; MultiheadAttention's projections are batched linears.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from phalanx.backends._bmm import linear_bmm
from phalanx.backends.rules._registry import Dims, batch_rule, first, per_member

_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {
    "attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False,
}  # fmt: skip


@batch_rule(F.scaled_dot_product_attention, _SDPA, _SDPA_DEFAULTS, table="speed")
def _attention(
    n: int,
    dims: Dims,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    dropout_p: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
) -> Any:
    """The members merged into the first batch dim: attention is per (sample, head) anyway."""
    q, k, v = (first(t, d, n) for t, d in zip((q, k, v), dims[:3]))
    if q.dim() < 4:  # one member's (T, D): no batch dim of its own to merge into
        return per_member(
            n, (0, 0, 0, dims[3]), F.scaled_dot_product_attention, q, k, v, mask,
            dropout_p, is_causal, scale, enable_gqa,
        )  # fmt: skip
    if mask is not None:
        m = first(mask, dims[3], n)
        m = m.expand(n, *torch.broadcast_shapes(m.shape[1:], (*q.shape[1:-1], k.shape[-2])))
        mask = m.flatten(0, 1)
    y = F.scaled_dot_product_attention(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), mask, dropout_p, is_causal,
        scale=scale, enable_gqa=enable_gqa,
    )  # fmt: skip
    return y.unflatten(0, (n, -1)), 0


_MHA = (
    "query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight",
    "in_proj_bias", "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight",
    "out_proj_bias", "training", "key_padding_mask", "need_weights", "attn_mask",
    "use_separate_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "static_k",
    "static_v", "average_attn_weights", "is_causal",
)  # fmt: skip
_MHA_DEFAULTS = {
    "training": True, "key_padding_mask": None, "need_weights": True, "attn_mask": None,
    "use_separate_proj_weight": False, "q_proj_weight": None, "k_proj_weight": None,
    "v_proj_weight": None, "static_k": None, "static_v": None, "average_attn_weights": True,
    "is_causal": False,
}  # fmt: skip


_PROJ = ("q_proj_weight", "k_proj_weight", "v_proj_weight")


def _float_mask(mask: Any, dtype: torch.dtype) -> Any:
    """A boolean mask as torch's attention takes it: -inf where True, else 0."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, -torch.inf)


@batch_rule(F.multi_head_attention_forward, _MHA, _MHA_DEFAULTS, table="speed")
def _mha(n: int, dims: Dims, *args: Any) -> Any:
    """``F.multi_head_attention_forward`` (nn.MultiheadAttention, TransformerEncoderLayer):
    the projections as batched linears and the attention of all members as one call.

    Python-level functionals run their body with the mode popped (a TorchFunctionMode sees
    only the outermost call), so without this rule the attention inside would go through
    torch.func's rules, a loop over the members. Packed or separate projection weights
    (kdim / vdim), bias_k / bias_v and add_zero_attn run batched here; static keys and
    attention weights asked for run member by member with torch's own function.
    """
    a, d = dict(zip(_MHA, args)), dict(zip(_MHA, dims))
    separate = a["use_separate_proj_weight"]
    extra = (a["bias_k"] is not None) + bool(a["add_zero_attn"])  # key columns appended
    common = (
        (a["bias_k"] is None) == (a["bias_v"] is None)
        and a["static_k"] is None
        and a["static_v"] is None
        and not a["need_weights"]
        and (a["q_proj_weight"] is not None if separate else a["in_proj_weight"] is not None)
        and a["query"].dim() - (d["query"] is not None) == 3
    )
    if not common:
        return per_member(n, dims, F.multi_head_attention_forward, *args)
    q, k, v = (first(a[x], d[x], n) for x in ("query", "key", "value"))  # (N, T, B, E)
    _, t, b, e = q.shape
    src = k.shape[1]
    heads = a["num_heads"]
    head_dim = e // heads
    bias = first(a["in_proj_bias"], d["in_proj_bias"], n)  # (N, 3E) | None
    bq, bk, bv = (None, None, None) if bias is None else bias.chunk(3, dim=1)

    def rows(x: torch.Tensor) -> torch.Tensor:
        """(N, L, B, X) -> (N, B * L, X): sample-major, a view for a batch-first input."""
        return x.transpose(1, 2).reshape(n, -1, x.shape[-1])

    # Projections (N, B, L, E), sample-major.
    if separate:  # kdim / vdim: one weight per projection
        wq, wk, wv = (first(a[x], d[x], n) for x in _PROJ)  # (N, E, E), (N, E, kdim), (N, E, vdim)
        qp = linear_bmm(rows(q), wq, bq).view(n, b, t, e)
        kp = linear_bmm(rows(k), wk, bk).view(n, b, src, e)
        vp = linear_bmm(rows(v), wv, bv).view(n, b, src, e)
    else:
        w = first(a["in_proj_weight"], d["in_proj_weight"], n)  # (N, 3E, E)
        if a["query"] is a["key"] is a["value"]:  # self-attention: one GEMM for q, k and v
            qkv = linear_bmm(rows(q), w, bias).view(n, b, t, 3 * e)
            qp, kp, vp = qkv.chunk(3, dim=-1)
        else:
            wq, wk, wv = w.chunk(3, dim=1)
            qp = linear_bmm(rows(q), wq, bq).view(n, b, t, e)
            kp = linear_bmm(rows(k), wk, bk).view(n, b, src, e)
            vp = linear_bmm(rows(v), wv, bv).view(n, b, src, e)
    if extra:  # as torch appends them: bias_k / bias_v, then a zero key and value
        ks, vs = [kp], [vp]
        if a["bias_k"] is not None:
            ks.append(first(a["bias_k"], d["bias_k"], n).view(n, 1, 1, e).expand(n, b, 1, e))
            vs.append(first(a["bias_v"], d["bias_v"], n).view(n, 1, 1, e).expand(n, b, 1, e))
        if a["add_zero_attn"]:
            ks.append(kp.new_zeros(n, b, 1, e))
            vs.append(vp.new_zeros(n, b, 1, e))
        kp, vp = torch.cat(ks, 2), torch.cat(vs, 2)
        src += extra

    def heads_of(y: torch.Tensor) -> torch.Tensor:
        """(N, B, L, E) projections -> (N * B, heads, L, head_dim)."""
        return y.reshape(n * b, y.shape[2], heads, head_dim).transpose(1, 2)

    qh, kh, vh = heads_of(qp), heads_of(kp), heads_of(vp)
    dtype = q.dtype
    is_causal = a["is_causal"]
    kpm = a["key_padding_mask"]
    mask = a["attn_mask"]
    if is_causal and mask is None:
        return per_member(n, dims, F.multi_head_attention_forward, *args)  # torch's error
    if kpm is not None:
        kpm = _float_mask(first(kpm, d["key_padding_mask"], n), dtype)  # (N, B, S)
        kpm = F.pad(kpm, (0, extra)) if extra else kpm
    if is_causal and kpm is None:
        mask = None
    else:
        is_causal = False
        if mask is not None:
            m = _float_mask(first(mask, d["attn_mask"], n), dtype)
            m = F.pad(m, (0, extra)) if extra else m
            # (N, T, S) for a 2-D mask, else (N, B * heads, T, S)
            mask = m.view(n, 1, 1, t, src) if m.dim() == 3 else m.view(n, b, heads, t, src)
    if kpm is not None:
        padding = kpm.view(n, b, 1, 1, src)
        mask = padding if mask is None else mask + padding
    if mask is not None:
        mask = mask.expand(n, b, heads, t, src).reshape(n * b, heads, t, src)
    dropout = a["dropout_p"] if a["training"] else 0.0
    out = F.scaled_dot_product_attention(qh, kh, vh, mask, dropout, is_causal)
    # (N * B, heads, T, hd) -> (N, B * T, E), the heads side by side as torch puts them
    out = out.transpose(1, 2).reshape(n, b * t, e)
    wo = first(a["out_proj_weight"], d["out_proj_weight"], n)
    bo = first(a["out_proj_bias"], d["out_proj_bias"], n)
    y = linear_bmm(out, wo, bo).view(n, b, t, wo.shape[1])
    # (N, T, B, E), each member's contiguous as torch's own output is
    return (y.transpose(1, 2).contiguous(), None), (0, None)
