"""Batching rules of phalanx's own: the layers whose cost or correctness torch.func gets wrong.

The ``fused`` and ``vmap`` backends run the member's own ``forward`` under
``torch.func.vmap`` over the member axis, so everything a forward does is per member by
construction: a mean over the batch is each member's mean, ``x[0]`` is each member's first
sample, and turning a member's data into a Python value (``bool``, ``.item()``) raises where
it happens instead of deciding once for all members. On top of that, :class:`BatchedOps`, a
``TorchFunctionMode`` pushed for the duration of one call (thread-local, like the vmap
levels themselves), routes a few functions to batching rules of phalanx's own, each written as
a ``torch.autograd.Function`` with a ``vmap`` staticmethod (torch's public extension point):

- correctness (both backends): convolutions run one per member (one grouped convolution
  over ``N * C`` channels, torch.func's rule, gives weight gradients up to 37,000x further from
  a float64 loop than the float32 loop is); embeddings check every id against the member's
  own table and raise ``IndexError`` as the module does (torch.func's rule offsets ids into
  one flattened table, so an id ``V`` of member 0 silently reads member 1's row 0), and keep
  ``padding_idx`` rows out of the gradient.
- speed (``fused`` only): Linear as one GEMM against every member's weights for a shared
  input, else one ``bmm`` whose weight gradient comes out in the stacked weight's own layout
  (``_bmm``); BatchNorm as one call over ``N * C`` channels; recurrent layers, which
  torch.func cannot batch, member by member with torch's own kernels.

A rule is a batching rule in the ordinary sense: it is told which dim of each argument is
batched and computes every batch element exactly as the function would alone, whatever that
batch is (the members, or a ``torch.func.vmap`` of the user's wrapped around the stack). Off
the vmap path (no argument batched) a rule's function runs as itself; its backward then
recomputes the function with autograd, so first and second derivatives are the function's
own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from phalanx import _torch_compat as compat
from phalanx.backends._bmm import linear_bmm, linear_shared
from phalanx.backends._recurrence import batched

Dims = Sequence[int | None]


def _first(t: Any, d: int | None, n: int) -> Any:
    """``t`` with its batch dim first, ``(n, ...)``; an unbatched ``t`` expanded to it."""
    if t is None:
        return None
    return t.movedim(d, 0) if d is not None else t.expand(n, *t.shape)


# ----------------------------------------------------------------------------------- the rules


def _linear(n: int, dims: Dims, x, w, b=None):
    xd, wd, bd = dims
    if wd is None and bd is None:  # only the input is batched: its batch is one more dim
        return F.linear(x, w, b), xd
    w = _first(w, wd, n)  # (N, out, in)
    b = _first(b, bd, n)  # (N, out) | None
    out_f, in_f = w.shape[1], w.shape[2]
    if xd is None:  # a shared input: one GEMM against every member's weights
        return linear_shared(x, w, b), x.dim() - 1  # (*, N, out)
    x = x.movedim(xd, 0)
    y = linear_bmm(x.reshape(n, -1, in_f), w, b)
    return y.reshape(*x.shape[:-1], out_f), 0


def _bilinear(n: int, dims: Dims, x1, x2, w, b=None):
    if dims[2] is None and dims[3] is None:
        return _per_member(n, dims, F.bilinear, x1, x2, w, b)
    a, c = _first(x1, dims[0], n), _first(x2, dims[1], n)  # (N, *, in1), (N, *, in2)
    w = _first(w, dims[2], n)  # (N, out, in1, in2)
    y = torch.einsum("nbi,noij,nbj->nbo", a.reshape(n, -1, a.shape[-1]), w,
                     c.reshape(n, -1, c.shape[-1]))  # fmt: skip
    if b is not None:
        y = y + _first(b, dims[3], n).unsqueeze(1)
    return y.reshape(*a.shape[:-1], w.shape[1]), 0


_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {
    "attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False,
}  # fmt: skip


def _attention(n: int, dims: Dims, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
    """The members merged into the first batch dim: attention is per (sample, head) anyway."""
    q, k, v = (_first(t, d, n) for t, d in zip((q, k, v), dims[:3]))
    if q.dim() < 4:  # one member's (T, D): no batch dim of its own to merge into
        return _per_member(
            n, (0, 0, 0, dims[3]), F.scaled_dot_product_attention, q, k, v, mask,
            dropout_p, is_causal, scale, enable_gqa,
        )  # fmt: skip
    if mask is not None:
        m = _first(mask, dims[3], n)
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


def _float_mask(mask: Any, dtype: torch.dtype) -> Any:
    """A boolean mask as torch's attention takes it: -inf where True, else 0."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, -torch.inf)


def _mha(n: int, dims: Dims, *args):
    """``F.multi_head_attention_forward`` (nn.MultiheadAttention, TransformerEncoderLayer):
    the projections as batched linears and the attention of all members as one call.

    Python-level functionals run their body with the mode popped (a TorchFunctionMode sees
    only the outermost call), so without this rule the attention inside would go through
    torch.func's rules, a loop over the members. The common configuration runs batched here;
    any other (separate projection weights, bias_k / bias_v, add_zero_attn, static keys,
    attention weights asked for) runs member by member with torch's own function.
    """
    a, d = dict(zip(_MHA, args)), dict(zip(_MHA, dims))
    common = (
        not a["use_separate_proj_weight"]
        and a["bias_k"] is None
        and a["bias_v"] is None
        and not a["add_zero_attn"]
        and a["static_k"] is None
        and a["static_v"] is None
        and not a["need_weights"]
        and a["in_proj_weight"] is not None
        and a["query"].dim() - (d["query"] is not None) == 3
    )
    if not common:
        return _per_member(n, dims, F.multi_head_attention_forward, *args)
    q, k, v = (_first(a[x], d[x], n) for x in ("query", "key", "value"))  # (N, T, B, E)
    _, t, b, e = q.shape
    src = k.shape[1]
    heads = a["num_heads"]
    head_dim = e // heads
    w = _first(a["in_proj_weight"], d["in_proj_weight"], n)  # (N, 3E, E)
    bias = _first(a["in_proj_bias"], d["in_proj_bias"], n)  # (N, 3E) | None

    def heads_of(y: torch.Tensor, length: int) -> torch.Tensor:
        """(N, B * L, E) projections -> (N * B, heads, L, head_dim)."""
        return y.view(n * b, length, heads, head_dim).transpose(1, 2)

    # Sample-major (N, B, L, E): a batch-first module's input is that already, a view.
    if a["query"] is a["key"] is a["value"]:  # self-attention: one GEMM for q, k and v
        x = q.transpose(1, 2).reshape(n, b * t, e)
        qkv = linear_bmm(x, w, bias)  # (N, B * T, 3E)
        qh, kh, vh = (heads_of(part, t) for part in qkv.chunk(3, dim=-1))
    else:
        wq, wk, wv = w.chunk(3, dim=1)
        bq, bk, bv = (None, None, None) if bias is None else bias.chunk(3, dim=1)
        qh = heads_of(linear_bmm(q.transpose(1, 2).reshape(n, b * t, e), wq, bq), t)
        kh = heads_of(linear_bmm(k.transpose(1, 2).reshape(n, b * src, e), wk, bk), src)
        vh = heads_of(linear_bmm(v.transpose(1, 2).reshape(n, b * src, e), wv, bv), src)
    dtype = q.dtype
    is_causal = a["is_causal"]
    kpm = a["key_padding_mask"]
    mask = a["attn_mask"]
    if is_causal and mask is None:
        return _per_member(n, dims, F.multi_head_attention_forward, *args)  # torch's error
    if kpm is not None:
        kpm = _float_mask(_first(kpm, d["key_padding_mask"], n), dtype)  # (N, B, S)
    if is_causal and kpm is None:
        mask = None
    else:
        is_causal = False
        if mask is not None:
            m = _float_mask(_first(mask, d["attn_mask"], n), dtype)
            # (N, T, S) for a 2-D mask, else (N, B * heads, T, S)
            mask = m.view(n, 1, 1, t, src) if m.dim() == 3 else m.view(n, b, heads, t, src)
    if kpm is not None:
        kp = kpm.view(n, b, 1, 1, src)
        mask = kp if mask is None else mask + kp
    if mask is not None:
        mask = mask.expand(n, b, heads, t, src).reshape(n * b, heads, t, src)
    dropout = a["dropout_p"] if a["training"] else 0.0
    out = F.scaled_dot_product_attention(qh, kh, vh, mask, dropout, is_causal)
    # (N * B, heads, T, hd) -> (N, B * T, E), the heads side by side as torch puts them
    out = out.transpose(1, 2).reshape(n, b * t, e)
    wo = _first(a["out_proj_weight"], d["out_proj_weight"], n)
    bo = _first(a["out_proj_bias"], d["out_proj_bias"], n)
    y = linear_bmm(out, wo, bo).view(n, b, t, wo.shape[1])
    return (y.transpose(1, 2), None), (0, None)  # (N, T, B, E), a view


def _check_ids(ids: torch.Tensor, rows: int) -> None:
    """Raises as ``nn.Embedding`` does when an id is outside ``[0, rows)``: an id outside a
    member's table must never read another member's rows."""
    if ids.numel() == 0:
        return
    low, high = torch.aminmax(ids)
    if ids.device.type == "cpu" and not compat.tracing():  # make_fx: no values to read
        if bool(low < 0) or bool(high >= rows):
            raise IndexError(
                f"index out of range in self: an embedding of {rows} rows got ids from "
                f"{int(low)} to {int(high)}"
            )
        return
    compat.assert_async((low >= 0) & (high < rows), "index out of range in self")


def _embedding(n: int, dims: Dims, ids, w, padding_idx, max_norm, norm_type, scale, sparse):
    idd, wd = dims[0], dims[1]
    if wd is None:
        y = F.embedding(ids, w, padding_idx, max_norm, norm_type, scale, sparse)
        return y, idd
    if sparse or scale:  # sparse gradients, or gradients scaled by counts in the flat table
        return _per_member(
            n, dims, _embedding_func, ids, w, padding_idx, max_norm, norm_type, scale, sparse
        )
    w = w.movedim(wd, 0)  # (N, V, D)
    v, d = w.shape[1], w.shape[2]
    _check_ids(ids, v)
    ids = _first(ids, idd, n)
    if max_norm is not None:  # as F.embedding: the rows looked up are renormalised in place
        with torch.no_grad():
            for i in range(n):
                torch.embedding_renorm_(w[i], ids[i], max_norm, norm_type)
    offsets = torch.arange(n, device=ids.device).mul_(v).view(n, *([1] * (ids.dim() - 1)))
    y = F.embedding(ids + offsets, w.reshape(n * v, d), scale_grad_by_freq=scale)
    if padding_idx is not None:  # rows at padding_idx take no gradient, as in nn.Embedding
        y = torch.where((ids == padding_idx).unsqueeze(-1), y.detach(), y)
    return y, 0


_EMBEDDING_BAG = (
    "input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode",
    "sparse", "per_sample_weights", "include_last_offset", "padding_idx",
)  # fmt: skip


def _embedding_bag(n: int, dims: Dims, *args):
    """Every member's bags in one call: ids offset into the members' tables side by side,
    after every id is checked against the member's own table (as the module raises)."""
    a, d = dict(zip(_EMBEDDING_BAG, args)), dict(zip(_EMBEDDING_BAG, dims))
    ids, w, offsets = a["input"], a["weight"], a["offsets"]
    if (
        d["weight"] is None
        or a["max_norm"] is not None
        or a["padding_idx"] is not None  # one padding id per member: not one in the flat table
        or a["include_last_offset"]
        or a["scale_grad_by_freq"]  # counts in the flat table's backward differ (measured)
        or (a["per_sample_weights"] is not None and d["per_sample_weights"] is None)
    ):
        return _per_member(n, dims, F.embedding_bag, *args)
    w = w.movedim(d["weight"], 0)  # (N, V, D)
    v, dim = w.shape[1], w.shape[2]
    _check_ids(ids, v)
    ids = _first(ids, d["input"], n)
    base = torch.arange(n, device=ids.device).mul_(v)
    psw = a["per_sample_weights"]
    psw = None if psw is None else _first(psw, d["per_sample_weights"], n).reshape(-1)
    if ids.dim() == 3 and offsets is None:  # (N, B, L): fixed-length bags
        flat, flat_offsets = (ids + base.view(n, 1, 1)).reshape(-1, ids.shape[-1]), None
        psw = None if psw is None else psw.view(flat.shape)
    elif ids.dim() == 2 and offsets is not None:  # (N, L) with (N, B) offsets
        length = ids.shape[1]
        flat = (ids + base.view(n, 1)).reshape(-1)
        offs = _first(offsets, d["offsets"], n)
        flat_offsets = offs + torch.arange(n, device=ids.device).mul_(length).view(n, 1)
        flat_offsets = flat_offsets.reshape(-1)
    else:
        return _per_member(n, dims, F.embedding_bag, *args)
    y = F.embedding_bag(
        flat, w.reshape(n * v, dim), flat_offsets, scale_grad_by_freq=a["scale_grad_by_freq"],
        mode=a["mode"], sparse=a["sparse"], per_sample_weights=psw,
    )  # fmt: skip
    return y.unflatten(0, (n, -1)), 0


def _conv(func: Callable[..., torch.Tensor], spatial: int, transposed: bool) -> Callable[..., Any]:
    def rule(n: int, dims: Dims, x, w, *rest):
        if all(d is None for d in dims[1:]):  # shared weights: the batch folds into the input's
            xd = dims[0]
            xs = x.movedim(xd, 0)
            y = func(xs.flatten(0, 1), w, *rest)
            return y.unflatten(0, (n, -1)), 0
        if dims[0] is None and not transposed and rest[4] == 1 and dims[1] is not None:
            bias, stride, padding, dilation, _ = rest
            # A shared input: one ordinary convolution with every member's filters side by
            # side, each output channel the member's own (not a grouped convolution, whose
            # weight gradients round far from the loop's).
            w = w.movedim(dims[1], 0)  # (N, out, in, *k)
            b = None if bias is None else _first(bias, dims[2], n).reshape(-1)
            y = func(x, w.flatten(0, 1), b, stride, padding, dilation, 1)
            at = 1 if x.dim() == spatial + 2 else 0  # (B, N * out, ...) or unbatched
            return y.unflatten(at, (n, -1)), at
        return _per_member(n, dims, func, x, w, *rest)

    return rule


def _batch_norm(n: int, dims: Dims, x, mean, var, w, b, training, momentum, eps):
    xd = dims[0]
    if all(d is None for d in dims[1:5]):
        xs = x.movedim(xd, 0)
        y = F.batch_norm(xs.flatten(0, 1), mean, var, w, b, training, momentum, eps)
        return y.unflatten(0, (n, -1)), 0
    xs = _first(x, xd, n)  # (N, B, C, *sp)
    stats = [_first(t, d, n) for t, d in zip((mean, var), dims[1:3])]
    if (
        any(d is None for d, t in zip(dims[1:5], (mean, var, w, b)) if t is not None)
        or xs.dim() < 3
        # the running statistics are updated in place through a flat view of them
        or any(t is not None and not t.is_contiguous() for t in stats)
    ):
        return _per_member(n, dims, F.batch_norm, x, mean, var, w, b, training, momentum, eps)
    channels = xs.transpose(0, 1).flatten(1, 2)  # (B, N * C, *sp)
    y = F.batch_norm(
        channels,
        None if stats[0] is None else stats[0].view(-1),
        None if stats[1] is None else stats[1].view(-1),
        None if w is None else _first(w, dims[3], n).reshape(-1),
        None if b is None else _first(b, dims[4], n).reshape(-1),
        training,
        momentum,
        eps,
    )
    return y.unflatten(1, (n, -1)).transpose(0, 1), 0


def _per_member(n: int, dims: Dims, func: Callable[..., Any], *args: Any):
    """``func`` on each batch element in turn: exact by construction, for what has no faster
    exact rule. Outputs (a tensor or a tuple of them) are stacked on dim 0."""
    unbound = [
        a.movedim(d, 0).unbind(0) if d is not None and isinstance(a, torch.Tensor) else None
        for a, d in zip(args, dims)
    ]
    outs = []
    for i in range(n):
        outs.append(func(*(a if u is None else u[i] for a, u in zip(args, unbound))))
    if isinstance(outs[0], torch.Tensor):
        return torch.stack(outs), 0
    stacked = tuple(torch.stack(col) for col in zip(*outs))
    return stacked, (0,) * len(stacked)


# --------------------------------------------------------------------------- the Function shell


def _tensors(args: Sequence[Any]) -> list[int]:
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]


def _function(name: str, func: Callable[..., Any], rule: Callable[..., Any]) -> Any:
    """An autograd.Function computing ``func``, batched under vmap by ``rule``."""

    def forward(*args: Any) -> Any:
        return func(*args)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        where = _tensors(inputs)
        ctx.where = where
        ctx.inputs = [None if isinstance(a, torch.Tensor) else a for a in inputs]
        ctx.save_for_backward(*(inputs[i] for i in where))
        ctx.save_for_forward(*(inputs[i] for i in where))

    def jvp(ctx: Any, *tangents: Any) -> Any:
        # Forward-mode AD off the vmap path: torch.func.jvp of ``func`` itself.
        inputs = list(ctx.inputs)
        for i, t in zip(ctx.where, ctx.saved_tensors):
            inputs[i] = t
        moving = [i for i in ctx.where if tangents[i] is not None]

        def along(*xs: torch.Tensor) -> Any:
            full = list(inputs)
            for i, x in zip(moving, xs):
                full[i] = x
            return func(*full)

        primals = tuple(inputs[i] for i in moving)
        return torch.func.jvp(along, primals, tuple(tangents[i] for i in moving))[1]

    def backward(ctx: Any, *grads: Any) -> tuple:
        # Off the vmap path only: recompute ``func`` with autograd and differentiate that,
        # so the gradients (and their own derivatives under create_graph) are ``func``'s.
        saved = ctx.saved_tensors
        inputs = list(ctx.inputs)
        wanted = [
            i for i, need in zip(ctx.where, [ctx.needs_input_grad[i] for i in ctx.where]) if need
        ]
        with torch.enable_grad():
            leaves = {}
            for i, t in zip(ctx.where, saved):
                leaves[i] = t.detach().requires_grad_(i in wanted) if t.is_floating_point() else t
                inputs[i] = leaves[i]
            out = func(*inputs)
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            got = (
                torch.autograd.grad(
                    [o for o, _ in pairs],
                    [leaves[i] for i in wanted],
                    [g for _, g in pairs],
                    create_graph=torch.is_grad_enabled(),
                    allow_unused=True,
                )
                if pairs and wanted
                else [None] * len(wanted)
            )
        result: list[Any] = [None] * len(inputs)
        for i, g in zip(wanted, got):
            result[i] = g
        return tuple(result)

    def vmap(info: Any, in_dims: tuple, *args: Any) -> Any:
        return rule(info.batch_size, in_dims, *args)

    return type(
        name,
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "jvp": staticmethod(jvp),
            "vmap": staticmethod(vmap),
        },
    )


Rule = Callable[[tuple, dict], Any]
"""Takes a routed function's ``args`` and ``kwargs`` and computes it."""


def _positional(
    name: str, func: Callable[..., Any], rule: Callable[..., Any], names, defaults
) -> Rule:
    """A rule for a function of fixed arguments, called through one Function."""
    fn = _function(name, func, rule)

    def route(args: tuple, kwargs: dict) -> Any:
        values = dict(zip(names, args))
        values.update(kwargs)
        full = tuple(values.get(k, defaults.get(k)) for k in names)
        if torch.compiler.is_exporting():  # torch.export cannot trace the Function under vmap
            out = compat.vmap_rule_inline(func, rule, full)
            if out is not None:
                return out
        return fn.apply(*full)

    return route


def _recurrent(func: Callable[..., Any], pairs: bool) -> Rule:
    """``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (the tensor and the
    PackedSequence forms), member by member with torch's own kernels: torch.func has no rule
    for them. Their states and weights come as lists, flattened here for the Function; one
    Function per layout (how many states and weights)."""
    made: dict[tuple[int, int, int, int], Any] = {}

    def route(args: tuple, kwargs: dict) -> Any:
        if kwargs:
            args = (*args, *kwargs.values())
        first = next(i for i, a in enumerate(args) if isinstance(a, (list, tuple)))
        at = first if pairs else first - 1  # where hx is: an LSTM's is the first list
        hx, weights, rest = args[at], args[at + 1], args[at + 2 :]
        states = list(hx) if pairs else [hx]
        layout = (at, len(states), len(weights), len(rest))
        if layout not in made:
            k, m = layout[1], layout[2]

            def call(*xs: Any) -> tuple:
                st, ws = xs[at : at + k], xs[at + k : at + k + m]
                out = func(*xs[:at], list(st) if pairs else st[0], list(ws), *xs[at + k + m :])
                return tuple(out)

            def rule(n: int, d: Dims, *xs: Any) -> Any:
                if at == 1 and not pairs:  # a tensor input (not packed) and one state
                    fast = batched(
                        func.__name__, n, (d[0], d[1], *d[2 : 2 + m]), xs[0], xs[1],
                        list(xs[2 : 2 + m]), tuple(xs[2 + m :]),
                    )  # fmt: skip
                    if fast is not None:
                        return fast
                return _per_member(n, d, call, *xs)

            made[layout] = _function(f"{func.__name__}_members", call, rule)
        return made[layout].apply(*args[:at], *states, *weights, *rest)

    return route


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
_EMB_NAMES = (
    "input",
    "weight",
    "padding_idx",
    "max_norm",
    "norm_type",
    "scale_grad_by_freq",
    "sparse",
)
_EMB_DEFAULTS = {
    "padding_idx": None,
    "max_norm": None,
    "norm_type": 2.0,
    "scale_grad_by_freq": False,
    "sparse": False,
}
_EB_DEFAULTS = {
    "offsets": None, "max_norm": None, "norm_type": 2, "scale_grad_by_freq": False, "mode": "mean",
    "sparse": False, "per_sample_weights": None, "include_last_offset": False, "padding_idx": None,
}  # fmt: skip
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


def _embedding_func(ids, w, padding_idx, max_norm, norm_type, scale, sparse):
    return F.embedding(ids, w, padding_idx, max_norm, norm_type, scale, sparse)


def _conv_rules() -> dict[Any, Rule]:
    rules = {}
    f: Any
    for k, f in enumerate((F.conv1d, F.conv2d, F.conv3d), start=1):
        rules[f] = _positional(f.__name__, f, _conv(f, k, False), _CONV_NAMES, _CONV_DEFAULTS)
    for k, f in enumerate((F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d), start=1):
        rule = _conv(f, k, True)
        rules[f] = _positional(f.__name__, f, rule, _CONVT_NAMES, _CONVT_DEFAULTS)
    return rules


CORRECTNESS: dict[Any, Rule] = {
    **_conv_rules(),
    F.embedding: _positional("embedding", _embedding_func, _embedding, _EMB_NAMES, _EMB_DEFAULTS),
    F.embedding_bag: _positional(
        "embedding_bag", F.embedding_bag, _embedding_bag, _EMBEDDING_BAG, _EB_DEFAULTS
    ),
}
"""The rules both backends use: where torch.func's own rule is not exact."""

SPEED: dict[Any, Rule] = {
    **CORRECTNESS,
    F.linear: _positional("linear", F.linear, _linear, ("input", "weight", "bias"), {"bias": None}),
    F.bilinear: _positional(
        "bilinear", F.bilinear, _bilinear, ("input1", "input2", "weight", "bias"), {"bias": None}
    ),
    F.scaled_dot_product_attention: _positional(
        "scaled_dot_product_attention",
        F.scaled_dot_product_attention,
        _attention,
        _SDPA,
        _SDPA_DEFAULTS,
    ),
    F.multi_head_attention_forward: _positional(
        "multi_head_attention_forward", F.multi_head_attention_forward, _mha, _MHA, _MHA_DEFAULTS
    ),
    F.batch_norm: _positional("batch_norm", F.batch_norm, _batch_norm, _BN_NAMES, _BN_DEFAULTS),
    torch.lstm: _recurrent(torch.lstm, pairs=True),
    torch.gru: _recurrent(torch.gru, pairs=False),
    torch.rnn_tanh: _recurrent(torch.rnn_tanh, pairs=False),
    torch.rnn_relu: _recurrent(torch.rnn_relu, pairs=False),
}
"""The fused backend's rules: the correctness rules and the batched layers."""


class BatchedOps(TorchFunctionMode):
    """Routes the functions in ``rules`` to phalanx's batching rules for one call."""

    def __init__(self, rules: dict[Any, Rule]) -> None:
        super().__init__()
        self.rules = rules

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.requires_grad_ and _fresh_leaf(args, kwargs):
            # A constant the forward made itself (``h0 = zeros(...).requires_grad_()``, as
            # GRU tutorials write it): a leaf no one outside the forward can differentiate
            # against. torch.func refuses ``requires_grad_`` inside a transform; leave it as is.
            return args[0]
        rule = self.rules.get(func)
        if rule is None:
            return func(*args, **(kwargs or {}))
        return rule(tuple(args), kwargs or {})


def _fresh_leaf(args: Any, kwargs: Any) -> bool:
    want = (
        kwargs.get("requires_grad", args[1] if len(args) > 1 else True)
        if kwargs
        else (args[1] if len(args) > 1 else True)
    )
    t = args[0]
    return bool(want) and not t.requires_grad and not compat.is_wrapped(t)
