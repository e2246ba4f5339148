"""Routed calls: each input row goes to its own member (or k of them), and member subsets.

``stack(x, members=index)`` sends row ``r`` of every positional input to member ``index[r]``
(``index`` of shape ``(B,)``) or to the k members ``index[r, :]`` (``(B, k)``) and returns
the rows in the input's order; ``weights=`` of the index's shape sums the k outputs of a row
with those weights (a mixture-of-experts layer). ``stack(x, subset=[i, j])`` runs members i
and j alone.

How a routed call runs. The flat ``(B * k,)`` routing is sorted once (stably, so that each
member sees its rows in the input's order, as the loop over members on their own rows does),
the inputs are gathered into that order, and each member's rows form one contiguous segment.
Then either

- the general path, for any member architecture: each member runs its own ``forward`` on
  its own segment (the loop backend's machinery: views of the stacked tensors, one copy of
  forward-written attributes per member), members without rows are skipped; or
- the segment path (backend ``fused`` or ``auto``), when the member's forward is proven
  row-wise by its structure: the forward is traced once with ``torch.fx`` and every
  operation of the trace is one whose result for a row depends on that row alone (Linear
  layers, elementwise operations and activations, ``torch.cat``/``chunk``/indexing along
  feature dimensions, reductions over feature dimensions); the trace is then run once over
  all rows, each Linear as a grouped GEMM over the member segments (``F.grouped_mm`` where
  torch runs it, else one GEMM per segment) and each member parameter read elsewhere
  gathered per row. No operation outside that list is run: an unknown one sends the call
  to the general path, and nothing is compared against a reference at run time, so there is
  no check per new count vector.

The outputs, in the sorted order, are put back in the input's order and, with ``weights``,
summed over the k choices. Both paths are ordinary autograd graphs (the grouped GEMM has
its own backward, recomputed with differentiable operations under ``create_graph=True``),
so input, parameter and weight gradients and second derivatives flow.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from phalanx import _torch_compat as compat
from phalanx._module_tree import meta_copy
from phalanx._torch_compat import pytree
from phalanx._warnings import warn
from phalanx.backends._bmm import linear_bmm, linear_ops
from phalanx.backends._loop import check_writes, member_rows, writable
from phalanx.backends._state import _INTERNALS, PerMemberAttributes, hooked
from phalanx.routing import Dispatch

if TYPE_CHECKING:
    from phalanx.backends import StackView

WHERE = "Stack.forward()"


# ------------------------------------------------------------------------------ validation


class Routing:
    """A checked routing: per flat entry its member, its row, and the sort into segments.

    Attributes:
        index: ``(B,)`` or ``(B, k)`` long tensor of members.
        weights: ``None`` or a tensor of the index's shape.
        keep: ``None`` or a bool tensor of the index's shape; False entries are dropped
            (their contribution is zero), e.g. rows over a member's capacity.
    """

    def __init__(
        self,
        index: torch.Tensor,
        weights: torch.Tensor | None,
        keep: torch.Tensor | None,
        num_members: int,
    ) -> None:
        self.index, self.weights, self.keep = index, weights, keep
        self.rows = index.shape[0]
        self.k = 1 if index.dim() == 1 else index.shape[1]
        flat = index.reshape(-1)
        position = torch.arange(flat.numel(), device=flat.device)
        if keep is not None:
            kept = keep.reshape(-1)
            position = position[kept]
            flat = flat[kept]
        order = torch.argsort(flat, stable=True)
        self.entries = position.index_select(0, order)  # flat positions in segment order
        self.source_rows = self.entries // self.k if self.k > 1 else self.entries
        self.member_of = flat.index_select(0, order)  # each sorted entry's member
        self.counts = torch.bincount(flat, minlength=num_members)
        self.count_list: list[int] = self.counts.tolist()  # the one host sync
        self.total = int(flat.numel())


def routing_from(
    members: Any, weights: Any, rows: int | None, num_members: int, device: torch.device | None
) -> Routing:
    """Checks ``members=``/``weights=`` against the inputs and the stack, naming the fix."""
    keep = None

    if isinstance(members, Dispatch):
        if weights is not None:
            raise ValueError(
                f"{WHERE}: members= is a phalanx.routing.Dispatch, which carries its own "
                f"weights; drop weights=."
            )
        members, weights, keep = members.index, members.weights, members.keep
    if not isinstance(members, torch.Tensor):
        raise TypeError(
            f"{WHERE}: members= routes input rows to members and takes an integer tensor, "
            f"(B,) or (B, k), one entry per input row; got a {type(members).__name__}. To run "
            f"only some members on the whole input, pass subset=[i, j, ...] instead; for a "
            f"routing held in a list, pass torch.tensor(index)."
        )
    if members.is_floating_point() or members.is_complex() or members.dtype == torch.bool:
        raise TypeError(
            f"{WHERE}: members= must hold integer member indices; got dtype {members.dtype}. "
            f"Convert it with index.long()."
        )
    if members.dim() not in (1, 2):
        raise ValueError(
            f"{WHERE}: members= must be (B,) (one member per row) or (B, k) (k members per "
            f"row); got shape {tuple(members.shape)}. Flatten the leading dims of the inputs "
            f"and the index first, e.g. x.flatten(0, 1) with index.flatten(0, 1)."
        )
    if rows is not None and members.shape[0] != rows:
        raise ValueError(
            f"{WHERE}: members= has {members.shape[0]} rows but the inputs have {rows}; give "
            f"one entry (or one row of k entries) per input row."
        )
    if device is not None and members.device != device:
        raise ValueError(
            f"{WHERE}: members= is on {members.device}, the inputs on {device}; move it with "
            f"index.to({str(device)!r})."
        )
    members = members.long()
    checked = members if keep is None else members[keep]
    if checked.numel():
        low, high = (int(v) for v in torch.aminmax(checked))
        if low < 0 or high >= num_members:
            bad = low if low < 0 else high
            raise IndexError(
                f"{WHERE}: members= holds member index {bad}, but the stack has {num_members} "
                f"members (indices 0 to {num_members - 1}); every entry must be a member index."
            )
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
            raise TypeError(
                f"{WHERE}: weights= must be a floating-point tensor of the index's shape "
                f"{tuple(members.shape)}; got "
                + (
                    f"dtype {weights.dtype}"
                    if isinstance(weights, torch.Tensor)
                    else type(weights).__name__
                )
                + "."
            )
        if weights.shape != members.shape:
            raise ValueError(
                f"{WHERE}: weights= must have the index's shape {tuple(members.shape)} (one "
                f"weight per routed entry); got {tuple(weights.shape)}."
            )
        if weights.device != members.device:
            raise ValueError(
                f"{WHERE}: weights= is on {weights.device}, members= on {members.device}; "
                f"put them on one device."
            )
    return Routing(members, weights, keep, num_members)


def routed_inputs(args: tuple[Any, ...]) -> tuple[int | None, torch.device | None]:
    """The rows and device of the routed positional inputs (every tensor among them)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        raise ValueError(
            f"{WHERE}: members= routes the rows of the positional inputs, but none is a "
            f"tensor; pass the input rows positionally, stack(x, members=index)."
        )
    rows = {a.shape[0] if a.dim() else None for a in tensors}
    if None in rows or len(rows) > 1:
        shapes = ", ".join(str(tuple(a.shape)) for a in tensors)
        raise ValueError(
            f"{WHERE}: with members= every positional tensor input is split by rows along "
            f"dim 0, so all must have the same first dimension; got {shapes}. Pass an input "
            f"every member sees whole as a keyword argument."
        )
    return rows.pop(), tensors[0].device


# ------------------------------------------------------------------------------ entry point


def routed_forward(
    view: StackView,
    requested: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    members: Any,
    weights: Any,
) -> Any:
    """``stack(*args, members=..., weights=..., **kwargs)``; see the module docstring."""
    rows, device = routed_inputs(args)
    routing = routing_from(members, weights, rows, view.num_members, device)
    gathered = tuple(
        a.index_select(0, routing.source_rows) if isinstance(a, torch.Tensor) else a for a in args
    )
    out = None
    cache = view.cache_of("routed")
    batched = requested in ("fused", "auto") and view.generators is None  # own generators: loop
    if batched and routing.total and not torch.compiler.is_compiling():
        out = _segment_path(view, requested, gathered, kwargs, routing)
    cache["last_path"] = "segment" if out is not None else "general"  # for tests and benches
    if out is None:
        out = _general_path(view, gathered, kwargs, routing)
    return _combine(out, routing)


def _general_path(
    view: StackView, gathered: tuple[Any, ...], kwargs: dict[str, Any], routing: Routing
) -> Any:
    """Each member's own forward on its own segment, as the loop over members runs it."""
    params, buffers = view.state()
    param_views = member_rows(params)  # rows a member may write in place, as the loop's
    tracked = [k for k, rows in param_views.items() if rows and writable(rows[0])]
    attributes = view.cache_of("loop").setdefault("attributes", PerMemberAttributes())
    outputs: list[Any] = []
    start = 0
    segments = [(i, c) for i, c in enumerate(routing.count_list) if c] or [
        (0, 0)
    ]  # no rows at all: member 0 on the empty input gives the output's structure
    for i, count in segments:
        state = {k: v[i] for k, v in param_views.items()}
        state.update({k: v[i] for k, v in buffers.items()})
        member_args = tuple(
            a.narrow(0, start, count) if isinstance(a, torch.Tensor) else a for a in gathered
        )
        start += count
        call = lambda: functional_call(view.module, state, member_args, kwargs)  # noqa: B023, E731
        if view.generators is not None:  # member i draws from its own generators
            call = partial(view.generators.run, i, call)
        versions = {k: compat.version(state[k]) for k in tracked}
        outputs.append(attributes.run(i, view.module, call))
        check_writes(i, params, state, versions)
    return _concat(outputs, [c for _, c in segments])


def _concat(outputs: list[Any], counts: list[int]) -> Any:
    """The members' segment outputs joined along dim 0, leaf by leaf."""
    flat0, spec0 = pytree.tree_flatten(outputs[0])
    columns: list[list[Any]] = [[leaf] for leaf in flat0]
    for out in outputs[1:]:
        flat, spec = pytree.tree_flatten(out)
        if spec != spec0:
            raise RuntimeError(
                f"{WHERE}: the members returned outputs of different structures ({spec} "
                f"against {spec0}); members must return the same structure."
            )
        for col, leaf in zip(columns, flat):
            col.append(leaf)
    joined = []
    for col in columns:
        if not isinstance(col[0], torch.Tensor):
            if any(v != col[0] for v in col[1:]):
                raise RuntimeError(
                    f"{WHERE}: the members returned different non-tensor values "
                    f"({col[0]!r}, ...); only tensor outputs can be routed."
                )
            joined.append(col[0])
            continue
        for t, c in zip(col, counts):
            if t.dim() == 0 or t.shape[0] != c:
                raise RuntimeError(
                    f"{WHERE}: with members= each output must have one row per input row, "
                    f"but a member given {c} rows returned a tensor of shape "
                    f"{tuple(t.shape)}; routed members must keep the rows on dim 0."
                )
        joined.append(col[0] if len(col) == 1 else torch.cat(col))
    return pytree.tree_unflatten(joined, spec0)


def _combine(out: Any, routing: Routing) -> Any:
    """Sorted outputs back in the input's order; with weights, summed over the k choices."""
    total_entries = routing.rows * routing.k
    dropped = routing.keep is not None and routing.total < total_entries
    if not dropped:
        inverse = torch.empty_like(routing.entries)
        inverse[routing.entries] = torch.arange(routing.total, device=inverse.device)

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if dropped:  # dropped entries contribute zero
            full = t.new_zeros(total_entries, *t.shape[1:])
            y = full.index_copy(0, routing.entries, t)
        else:
            y = t.index_select(0, inverse)
        if routing.index.dim() == 2:
            y = y.view(routing.rows, routing.k, *t.shape[1:])
        if routing.weights is None:
            return y
        w = routing.weights.to(y.dtype)
        if routing.index.dim() == 1:
            return y * w.view(-1, *(1,) * (y.dim() - 1))
        return (y * w.view(*w.shape, *(1,) * (y.dim() - 2))).sum(1)

    return pytree.tree_map(leaf, out)


# ---------------------------------------------------------------------- segment Linear layer


class Segments:
    """The sorted rows' partition into member segments, in the forms the kernels need.

    Attributes:
        members: the member of each segment, in row order (distinct).
        count_list: the rows of each segment.
        member_of: ``(R,)`` each row's member.
        num_members: N.
    """

    def __init__(
        self, members: list[int], counts: list[int], member_of: torch.Tensor, num_members: int
    ) -> None:
        self.members, self.count_list, self.member_of = members, counts, member_of
        self.num_members = num_members
        self.rows = sum(counts)
        self.equal = len(set(counts)) == 1
        self.whole = members == list(range(num_members))
        self._index: torch.Tensor | None = None
        self._offsets: dict[int, torch.Tensor] = {}

    @classmethod
    def of(cls, routing: Routing, num_members: int) -> Segments:
        members = [i for i, c in enumerate(routing.count_list) if c]
        counts = [routing.count_list[i] for i in members]
        return cls(members, counts, routing.member_of, num_members)

    def index(self, device: torch.device) -> torch.Tensor:
        if self._index is None:
            self._index = torch.tensor(self.members, device=device)
        return self._index

    @property
    def consecutive(self) -> bool:
        """The segments' members are consecutive: ``select`` gives a view."""
        first = self.members[0]
        return self.members == list(range(first, first + len(self.members)))

    def select(self, t: torch.Tensor) -> torch.Tensor:
        """The segments' members' rows of a stacked tensor, ``(G, ...)``."""
        if self.whole:
            return t
        if self.consecutive:
            return t[self.members[0] : self.members[0] + len(self.members)]
        return t.index_select(0, self.index(t.device))

    def scaled(self, inner: int, device: torch.device) -> tuple[list[int], torch.Tensor]:
        """Counts and ``grouped_mm`` offsets when every row holds ``inner`` vectors."""
        if inner not in self._offsets:
            ends = torch.tensor(self.count_list, device=device).mul_(inner).cumsum(0)
            self._offsets[inner] = ends.to(torch.int32)
        return [c * inner for c in self.count_list], self._offsets[inner]


_GROUPED_DTYPES = {torch.float32, torch.bfloat16, torch.float16}
GROUPED_ROWS = 512
GROUPED_SEGMENTS = 32
"""``F.grouped_mm`` runs a segment Linear from this many segments on, with up to
``GROUPED_ROWS`` rows per segment on average: many small GEMMs, where one call per segment
costs more in Python than in arithmetic. Elsewhere one GEMM per segment is as fast or faster
on the CPUs measured (docs/ROUTED.md)."""


def _use_grouped(x: torch.Tensor, w: torch.Tensor, segments: int) -> bool:
    grouped = getattr(F, "grouped_mm", None)
    if grouped is None or x.dtype not in _GROUPED_DTYPES or w.dtype != x.dtype:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16
    if x.device.type != "cpu":
        return False
    size = x.element_size()
    out_f, in_f = w.shape[1], w.shape[2]
    # grouped_mm wants every stride a multiple of 16 bytes
    aligned = (in_f * size) % 16 == 0 and (out_f * size) % 16 == 0
    return aligned and segments >= GROUPED_SEGMENTS and x.shape[0] <= GROUPED_ROWS * segments


def _segment_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    seg: Segments,
    counts: list[int],
    offs: torch.Tensor,
    member_of: torch.Tensor | None,
    grouped: bool,
    act: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``y[s] = x[s] @ w[m].T + b[m]`` for each segment s of the rows of ``x``, m its member;
    ``act``, an activation applied in place, on each segment's output right after it."""
    if grouped:
        y = F.grouped_mm(x, seg.select(w).transpose(1, 2), offs=offs)
        if b is not None:
            assert member_of is not None
            y.add_(b.index_select(0, member_of))
        return y if act is None else act(y)
    y = x.new_empty(x.shape[0], w.shape[1])
    for m, xs, ys in zip(seg.members, x.split(counts), y.split(counts)):
        if b is None:
            torch.mm(xs, w[m].t(), out=ys)
        else:
            torch.addmm(b[m], xs, w[m].t(), out=ys)
        if act is not None:  # while the segment's output is in cache
            act(ys)
    return y


def _segment_differentiable(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, seg: Segments, counts: list[int]
) -> torch.Tensor:
    """The same with ordinary autograd operations (for second derivatives)."""
    parts = [
        F.linear(xs, w[m], None if b is None else b[m])
        for m, xs in zip(seg.members, x.split(counts))
    ]
    return torch.cat(parts) if parts else x.new_empty(0, w.shape[1])


class _SegmentLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, w, b, seg, counts, offs, member_of, grouped):
        ctx.save_for_backward(x, w, b, offs, member_of)
        ctx.seg, ctx.counts, ctx.grouped = seg, counts, grouped
        return _segment_mm(x, w, b, seg, counts, offs, member_of, grouped)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        x, w, b, offs, member_of = ctx.saved_tensors
        seg, counts, grouped = ctx.seg, ctx.counts, ctx.grouped
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 5
        if torch.is_grad_enabled():  # create_graph=True: differentiate a differentiable replay
            inputs = [x, w, b]
            wanted = [i for i, t in enumerate(inputs) if t is not None and ctx.needs_input_grad[i]]
            with torch.enable_grad():
                y = _segment_differentiable(x, w, b, seg, counts)
                got = torch.autograd.grad(
                    y, [inputs[i] for i in wanted], g, create_graph=True, allow_unused=True
                )
            grads: list[Any] = [None, None, None]
            for i, gi in zip(wanted, got):
                grads[i] = gi if gi is not None else torch.zeros_like(inputs[i])
            return (*grads, *none)
        g = g.contiguous()
        gx = gw = gb = None
        if grouped:
            ws = seg.select(w)
            if need_x:
                gx = F.grouped_mm(g, ws, offs=offs)
            if need_w:
                gws = F.grouped_mm(g.t(), x, offs=offs)
                gw = (
                    gws
                    if seg.whole
                    else w.new_zeros(w.shape).index_copy_(0, seg.index(w.device), gws)
                )
        else:
            if need_x:
                gx = x.new_empty(x.shape)
                for m, gs, out in zip(seg.members, g.split(counts), gx.split(counts)):
                    torch.mm(gs, w[m], out=out)
            if need_w:
                gw = w.new_zeros(w.shape)
                for m, gs, xs in zip(seg.members, g.split(counts), x.split(counts)):
                    torch.mm(gs.t(), xs, out=gw[m])
        if need_b and b is not None:
            gb = b.new_zeros(b.shape).index_add_(0, member_of, g)
        return gx, gw, gb, *none


def segment_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    seg: Segments,
    act: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, bool]:
    """Every sorted row through its own member's Linear: ``x (R, ..., in)``, ``w (N, out, in)``,
    ``b (N, out) | None`` -> ``(R, ..., out)``, and whether ``act`` (an in-place activation,
    applied only where no autograd graph is recorded) was applied to it.

    Equal segments (a subset, an even routing) run as one ``bmm``; one segment as the
    member's own ``F.linear``; others as ``F.grouped_mm`` or one GEMM per segment.
    """
    if x.dtype != w.dtype or (b is not None and b.dtype != w.dtype):
        raise _NotRowwise(f"a Linear layer meets dtypes {x.dtype} and {w.dtype}")
    lead = x.shape[:-1]
    out_f = w.shape[1]
    graph = torch.is_grad_enabled() and (
        x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)
    )
    if graph:
        act = None
    if len(seg.members) == 1:
        m = seg.members[0]
        y = F.linear(x, w[m], None if b is None else b[m])
        return (y, False) if act is None else (act(y), True)
    if seg.equal and seg.consecutive:  # one bmm over a view of the stacked weights
        xs = x.reshape(len(seg.members), -1, x.shape[-1])
        ws, bs = seg.select(w), None if b is None else seg.select(b)
        y = (linear_bmm(xs, ws, bs) if graph else linear_ops(xs, ws, bs)).view(*lead, out_f)
        return (y, False) if act is None else (act(y), True)
    inner = math.prod(lead[1:])
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or x2.stride(0) != x2.shape[-1]:
        x2 = x2.contiguous()
    counts, offs = seg.scaled(inner, x.device)
    grouped = _use_grouped(x2, w, len(seg.members))
    member_of = None
    if b is not None:
        member_of = seg.member_of if inner == 1 else seg.member_of.repeat_interleave(inner)
    if graph:
        y = _SegmentLinear.apply(x2, w, b, seg, counts, offs, member_of, grouped)
    else:
        y = _segment_mm(x2, w, b, seg, counts, offs, member_of, grouped, act)
    return y.view(*lead, out_f), act is not None


# -------------------------------------------------------------------- the row-wise segment path


class _NotRowwise(Exception):
    """The trace holds an operation the segment path does not prove row-wise."""


class _R:
    """A row tensor: dim 0 holds the sorted rows."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _M:
    """A member tensor: the stacked ``(N, *shape)`` parameter or buffer (or one derived from
    them by per-member operations)."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


_ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Softplus,
    nn.ELU, nn.CELU, nn.SELU, nn.Mish, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
    nn.Identity, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid, nn.Hardshrink, nn.Softshrink,
    nn.Threshold,
)  # fmt: skip
_DROPOUT_MODULES: tuple[type[nn.Module], ...] = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)  # fmt: skip

# Functions whose every output element depends on the same element of each input (after
# broadcasting): on rows, each row's result is the row's own.
_ELEMENTWISE_FUNCTIONS: set[Any] = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.pos, operator.abs, operator.eq,
    operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_,
    operator.or_, operator.invert,
    torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div, torch.divide,
    torch.true_divide, torch.pow, torch.neg, torch.abs, torch.exp, torch.exp2, torch.expm1,
    torch.log, torch.log1p, torch.log2, torch.log10, torch.sqrt, torch.rsqrt, torch.square,
    torch.sin, torch.cos, torch.tan, torch.tanh, torch.sigmoid, torch.relu, torch.erf,
    torch.erfc, torch.sign, torch.floor, torch.ceil, torch.round, torch.trunc, torch.clamp,
    torch.clip, torch.clamp_min, torch.clamp_max, torch.where, torch.maximum, torch.minimum,
    torch.reciprocal, torch.nan_to_num, torch.logaddexp, torch.atan2, torch.hypot,
    torch.asin, torch.acos, torch.atan, torch.sinh, torch.cosh, torch.lerp, torch.addcmul,
    torch.addcdiv, torch.fmod, torch.remainder, torch.logical_and, torch.logical_or,
    torch.logical_not, torch.isfinite, torch.isnan, torch.eq, torch.ne, torch.lt, torch.le,
    torch.gt, torch.ge,
    F.relu, F.relu6, F.silu, F.gelu, F.elu, F.selu, F.celu, F.leaky_relu, F.softplus,
    F.mish, F.hardtanh, F.hardswish, F.hardsigmoid, F.logsigmoid, F.softsign, F.tanhshrink,
    F.sigmoid, F.tanh, F.hardshrink, F.softshrink, F.threshold,
}  # fmt: skip
_ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "true_divide", "pow", "neg", "abs", "exp", "exp2", "expm1",
    "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "square", "sin", "cos", "tan", "tanh",
    "sigmoid", "relu", "erf", "sign", "floor", "ceil", "round", "trunc", "clamp", "clip",
    "clamp_min", "clamp_max", "reciprocal", "maximum", "minimum", "lerp", "nan_to_num",
    "float", "double", "half", "bfloat16", "to", "type_as", "contiguous", "clone",
    "__add__", "__sub__", "__mul__", "__truediv__", "__radd__", "__rsub__", "__rmul__",
    "__rtruediv__", "__neg__", "__pow__", "__rpow__", "eq", "ne", "lt", "le", "gt", "ge",
    "masked_fill", "logical_not", "isfinite", "isnan", "fmod", "remainder", "addcmul", "where",
}  # fmt: skip
# Operations along one dim (or a tuple of dims); on rows, row-wise when no dim is 0.
_DIM_FUNCTIONS: dict[Any, tuple[int, str, Any]] = {
    # function: (position of the dim argument, its name, its default)
    torch.softmax: (1, "dim", None),
    torch.log_softmax: (1, "dim", None),
    F.softmax: (1, "dim", None),
    F.log_softmax: (1, "dim", None),
    F.normalize: (2, "dim", 1),
    torch.sum: (1, "dim", None),
    torch.mean: (1, "dim", None),
    torch.amax: (1, "dim", None),
    torch.amin: (1, "dim", None),
    torch.prod: (1, "dim", None),
    torch.logsumexp: (1, "dim", None),
    torch.cumsum: (1, "dim", None),
    torch.cumprod: (1, "dim", None),
    torch.chunk: (2, "dim", 0),
    torch.split: (2, "dim", 0),
    torch.unbind: (1, "dim", 0),
    torch.flatten: (1, "start_dim", 0),
    torch.unsqueeze: (1, "dim", None),
    torch.squeeze: (1, "dim", None),
}
_DIM_METHODS: dict[str, tuple[int, str, Any]] = {
    "softmax": (1, "dim", None),
    "log_softmax": (1, "dim", None),
    "sum": (1, "dim", None),
    "mean": (1, "dim", None),
    "amax": (1, "dim", None),
    "amin": (1, "dim", None),
    "prod": (1, "dim", None),
    "logsumexp": (1, "dim", None),
    "cumsum": (1, "dim", None),
    "cumprod": (1, "dim", None),
    "chunk": (2, "dim", 0),
    "split": (2, "dim", 0),
    "unbind": (1, "dim", 0),
    "flatten": (1, "start_dim", 0),
    "unsqueeze": (1, "dim", None),
    "squeeze": (1, "dim", None),
}
_NEW_DIM = {torch.unsqueeze, "unsqueeze"}  # the dim counts in the result's rank
_CONSTRUCTORS = {
    torch.arange, torch.zeros, torch.ones, torch.full, torch.tensor, torch.linspace,
    torch.logspace, torch.eye, torch.as_tensor,
}  # fmt: skip
_CAT = {torch.cat, torch.concat, torch.concatenate, torch.stack}
_MATMUL = {operator.matmul, torch.matmul, torch.mm, "matmul", "mm", "__matmul__"}
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _fingerprint(module: nn.Module) -> tuple | str:
    """What a trace bakes in: the module tree (each submodule's identity and type) and, for
    the modules the trace runs through (fx calls torch.nn's own layers as they are, reading
    their settings on every call), their mode and plain attributes; a string (the reason)
    when such a module holds an attribute whose changes a trace could not see."""

    leaf = _LEAF.is_leaf_module
    parts: list[Any] = []
    for path, m in module.named_modules():
        if leaf(m, path):
            parts.append((path, id(m)))
            continue
        own = []
        for k, v in m.__dict__.items():
            if k in _INTERNALS:
                continue
            if _plain(v):
                own.append((k, v))
            elif callable(v) and not isinstance(v, (nn.Module, torch.Tensor)):
                own.append((k, id(v)))
            else:
                return (
                    f"{type(m).__name__} {path or 'the member'} holds {k!r}, a {type(v).__name__}"
                )
        parts.append((path, id(m), type(m), m.training, tuple(own)))
    return tuple(parts)


_LEAF = torch.fx.Tracer()


class _Plan:
    def __init__(self, fingerprint: Any, graph: Any, constants: Any) -> None:
        self.fingerprint = fingerprint
        self.graph = graph
        self.constants = constants  # the traced module, for tensor constants it recorded
        self.refused: dict[Any, str] = {}  # per input signature
        self.steps: list[tuple] | None = None  # the graph compiled against the live modules
        self.placeholders = 0


def _loader(value: Any, index: dict[Any, int]) -> Callable[[list[Any]], Any]:
    """A function from the values computed so far to ``value`` with its nodes filled in."""
    node_type = torch.fx.Node
    if isinstance(value, node_type):
        i = index[value]
        return lambda env: env[i]
    if not any(isinstance(v, node_type) for v in _leaves(value)):
        return lambda env: value
    if type(value) in (tuple, list) and not any(
        isinstance(v, (tuple, list, dict, slice)) for v in value
    ):
        items = [(True, index[v]) if isinstance(v, node_type) else (False, v) for v in value]
        kind = type(value)
        return lambda env: kind(env[v] if ref else v for ref, v in items)
    if type(value) is dict and not any(
        isinstance(v, (tuple, list, dict, slice)) for v in value.values()
    ):
        entries = [
            (k, True, index[v]) if isinstance(v, node_type) else (k, False, v)
            for k, v in value.items()
        ]
        return lambda env: {k: env[v] if ref else v for k, ref, v in entries}
    return lambda env: _map(lambda a: env[index[a]] if isinstance(a, node_type) else a, value)


def _compile(plan: _Plan, live: nn.Module) -> list[tuple]:
    """The graph as steps ``(op, target, args loader, kwargs loader, extra)`` against the
    live modules. A Linear whose one user is an activation module gets that activation as
    ``extra``, to run in place inside its segment loop where no graph is recorded; the
    activation's step (op "activation", ``extra`` the Linear's step) then passes it on."""
    nodes = list(plan.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    steps: list[tuple] = []
    placeholder = 0
    for n in nodes:
        if n.op == "placeholder":
            default = n.args[0] if n.args else _NO_DEFAULT
            steps.append(("placeholder", placeholder, default, None, None))
            placeholder += 1
        elif n.op == "get_attr":
            steps.append(("get_attr", n.target, None, None, None))
        elif n.op == "call_module":
            mod = live.get_submodule(n.target)
            args, kwargs = _loader(n.args, index), _loader(n.kwargs, index)
            source = n.args[0] if len(n.args) == 1 and not n.kwargs else None
            if (
                type(mod) in _IN_PLACE
                and isinstance(source, torch.fx.Node)
                and source.op == "call_module"
                and type(live.get_submodule(source.target)) is nn.Linear  # type: ignore[arg-type]
                and len(source.users) == 1
                and len(source.args) == 1
                and not source.kwargs
            ):
                linear = index[source]
                steps[linear] = (*steps[linear][:4], mod)
                steps.append(("activation", mod, args, kwargs, linear))
                continue
            steps.append(("call_module", mod, args, kwargs, None))
        elif n.op in ("call_function", "call_method"):
            steps.append((n.op, n.target, _loader(n.args, index), _loader(n.kwargs, index), None))
        elif n.op == "output":
            steps.append(("output", None, _loader(n.args[0], index), None, None))
    plan.placeholders = placeholder
    return steps


def _in_place(mod: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation module's own function, in place, with its settings read now."""
    kind = type(mod)
    if kind is nn.ReLU:
        return torch.relu_
    if kind is nn.SiLU:
        return lambda t: F.silu(t, inplace=True)
    if kind is nn.Tanh:
        return torch.tanh_
    if kind is nn.Sigmoid:
        return torch.sigmoid_
    assert isinstance(mod, nn.LeakyReLU)
    slope = mod.negative_slope
    return lambda t: F.leaky_relu_(t, slope)


_IN_PLACE = (nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU)


_NO_DEFAULT = object()


def _plan(view: StackView) -> _Plan | str:
    """The member's forward traced once (again only when a baked-in attribute changed)."""
    cache = view.cache_of("routed")
    fingerprint = _fingerprint(view.module)
    if isinstance(fingerprint, str):
        return fingerprint
    plan = cache.get("plan")
    if plan is not None and plan.fingerprint == fingerprint:
        return plan

    try:
        traced = torch.fx.symbolic_trace(meta_copy(view.module))
    except Exception as e:  # control flow on data, an untraceable call: the general path
        text = str(e).strip().splitlines()
        plan = _Plan(fingerprint, None, None)
        plan.refused[None] = (
            f"torch.fx cannot trace the member's forward ({type(e).__name__}: "
            f"{text[0] if text else ''})"
        )
    else:
        plan = _Plan(fingerprint, traced.graph, traced)
    cache["plan"] = plan
    return plan


def _segment_path(
    view: StackView,
    requested: str,
    gathered: tuple[Any, ...],
    kwargs: dict[str, Any],
    routing: Routing,
) -> Any:
    """The trace run once over all sorted rows, or None (then the general path runs)."""
    reason = _blocked(view, gathered, kwargs)
    plan: _Plan | str | None = None
    signature = tuple((a.dim(), a.dtype) for a in gathered)
    if reason is None:
        plan = _plan(view)
        if isinstance(plan, str):
            reason = plan
        elif None in plan.refused:
            reason = plan.refused[None]
        else:
            reason = plan.refused.get(signature)
    if reason is None:
        assert isinstance(plan, _Plan)
        try:
            return _run(plan, view, gathered, Segments.of(routing, view.num_members))
        except _NotRowwise as e:
            reason = str(e)
            plan.refused[signature] = reason
    if requested == "fused":
        _warn_once(view, reason)
    return None


def _blocked(view: StackView, gathered: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    if kwargs:
        return "keyword inputs (shared by every member) are not part of the segment path"
    if not all(isinstance(a, torch.Tensor) for a in gathered):
        return "a positional input is not a tensor"
    if hooked(view.module):
        return "the member holds hooks, which must run once per member"
    if compat.transforms_active() or compat.forward_ad_active():
        return "a torch.func transform or forward-mode AD is around the stack"
    if torch.is_autocast_enabled(gathered[0].device.type):
        return "autocast is on"
    return None


def _warn_once(view: StackView, reason: str) -> None:
    cache = view.cache_of("routed")
    if cache.get("warned"):
        return
    cache["warned"] = True
    warn(
        f"phalanx: backend 'fused' runs routed calls (members=) member by member on their "
        f"own rows (exact, not batched): {reason}. The segment path runs members whose "
        f"forward is row-wise by construction (Linear layers, elementwise operations, "
        f"feature-dim cat/chunk/indexing/reductions); backend='auto' takes the same paths "
        f"without this warning."
    )


def _dim(d: Any, rank: int) -> int:
    if not isinstance(d, int) or isinstance(d, bool):
        raise _NotRowwise(f"a dim given as {type(d).__name__}")
    if not -rank <= d < rank:
        raise _NotRowwise("a dim out of range")
    return d % rank


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` on every leaf of the tuples, lists, dicts and slices of an fx argument (a
    faster ``tree_map`` for the few containers a trace holds)."""
    if isinstance(value, (tuple, list)):
        return (
            type(value)(_map(fn, v) for v in value)
            if type(value) in (tuple, list)
            else [_map(fn, v) for v in value]
        )
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_map(fn, value.start), _map(fn, value.stop), _map(fn, value.step))
    return fn(value)


def _leaves(value: Any, out: list[Any] | None = None) -> list[Any]:
    out = [] if out is None else out
    if isinstance(value, (tuple, list)):
        for v in value:
            _leaves(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _leaves(v, out)
    elif isinstance(value, slice):
        _leaves((value.start, value.stop, value.step), out)
    else:
        out.append(value)
    return out


def _unwrap(value: Any) -> Any:
    return _map(lambda v: v.t if isinstance(v, (_R, _M)) else v, value)


def _run(plan: _Plan, view: StackView, args: tuple[torch.Tensor, ...], seg: Segments) -> Any:
    live = view.module
    if plan.steps is None:
        plan.steps = _compile(plan, live)
    if len(args) > plan.placeholders:
        raise _NotRowwise("more positional inputs than the traced forward takes")
    member_ids: set[int] | None = None
    env: list[Any] = []
    append = env.append
    fused: set[int] = set()  # the Linear steps whose activation ran inside them
    for op, target, load_args, load_kwargs, extra in plan.steps:
        if op == "call_module":
            if extra is not None:  # a Linear, and the activation that follows it
                x = load_args(env)[0]
                if isinstance(x, _R) and x.t.dim() >= 2:
                    weight, bias = target.weight, target.bias
                    y, done = segment_linear(x.t, weight, bias, seg, _in_place(extra))
                    if done:
                        fused.add(len(env))
                    append(_R(y))
                    continue
            append(_call_module(target, load_args(env), load_kwargs(env), seg))
        elif op == "activation":
            if extra in fused:
                append(env[extra])
            else:
                append(_call_module(target, load_args(env), load_kwargs(env), seg))
        elif op == "call_function" or op == "call_method":
            append(_call(op, target, load_args(env), load_kwargs(env), seg))
        elif op == "placeholder":
            if target < len(args):
                append(_R(args[target]))
            elif load_args is not _NO_DEFAULT:
                append(load_args)  # the argument's default
            else:
                raise _NotRowwise("a positional input is missing")
        elif op == "get_attr":
            if member_ids is None:
                member_ids = {id(t) for t in (*live.parameters(), *live.buffers())}
            append(_attr(live, plan.constants, target, member_ids))
        elif op == "output":
            out = load_args(env)
            for leaf in _leaves(out):
                if isinstance(leaf, _M) or (
                    isinstance(leaf, torch.Tensor) and not isinstance(leaf, _R)
                ):
                    raise _NotRowwise("an output that is not made of the input rows")
                if isinstance(leaf, _R) and (leaf.t.dim() == 0 or leaf.t.shape[0] != seg.rows):
                    raise _NotRowwise("an output without one row per input row")
            return _unwrap(out)
    raise _NotRowwise("the trace has no output")


def _attr(live: nn.Module, constants: nn.Module, target: str, member_ids: set[int]) -> Any:
    value: Any = live
    try:
        for part in target.split("."):
            value = getattr(value, part)
    except AttributeError:
        value = constants
        for part in target.split("."):
            value = getattr(value, part)
        return value  # a tensor constant of the trace: the same for every member
    if isinstance(value, torch.Tensor):
        if id(value) not in member_ids:
            raise _NotRowwise(f"the forward reads tensor attribute {target!r}")
        return _M(value)
    raise _NotRowwise(f"the forward reads attribute {target!r}")


def _check_rank(t: torch.Tensor, rank: int, what: str) -> None:
    """A constant (or a member's own tensor, without its member dim) that broadcasts against
    rows of ``rank`` dims without reaching the row dim."""
    if t.dim() > rank or (t.dim() == rank and t.shape[0] != 1):
        raise _NotRowwise(f"{what} of shape {tuple(t.shape)} broadcasts over the rows")


def _elementwise(fn: Callable[..., Any], args: Any, kwargs: Any, seg: Segments) -> Any:
    leaves = _leaves((args, kwargs))
    rows = [v for v in leaves if isinstance(v, _R)]
    members = [v for v in leaves if isinstance(v, _M)]
    consts = [v for v in leaves if isinstance(v, torch.Tensor)]
    if not rows and not members:
        return fn(*args, **kwargs)
    if not rows:  # per-member tensors only: broadcast each after its member dim
        rank = max([m.t.dim() - 1 for m in members] + [c.dim() for c in consts])

        def lift(v: Any) -> Any:
            if isinstance(v, _M):
                return v.t.reshape(v.t.shape[0], *(1,) * (rank - v.t.dim() + 1), *v.t.shape[1:])
            return v

        a, k = _map(lift, (args, kwargs))
        return _M(fn(*a, **k))
    rank = rows[0].t.dim()
    if rank == 0 or any(r.t.dim() != rank for r in rows):
        raise _NotRowwise("an elementwise operation between row tensors of different ranks")
    for c in consts:
        _check_rank(c, rank, "a constant tensor")

    def per_row(v: Any) -> Any:
        if isinstance(v, _R):
            return v.t
        if isinstance(v, _M):
            own = v.t.shape[1:]
            _check_rank(v.t[0], rank, "a member tensor")
            shape = own[1:] if len(own) == rank else (1,) * (rank - 1 - len(own)) + tuple(own)
            return v.t.reshape(v.t.shape[0], *shape).index_select(0, seg.member_of)
        return v

    a, k = _map(per_row, (args, kwargs))
    out = fn(*a, **k)
    if not isinstance(out, torch.Tensor) or out.dim() != rank or out.shape[0] != seg.rows:
        raise _NotRowwise("an elementwise operation that changed the rows")
    return _R(out)


def _call_module(mod: nn.Module, args: Any, kwargs: Any, seg: Segments) -> Any:
    kind = type(mod)
    x = args[0] if args else None
    if kind is nn.Linear:
        if len(args) != 1 or kwargs or not isinstance(x, _R):
            raise _NotRowwise("a Linear layer on something other than the rows")
        if x.t.dim() < 2:
            raise _NotRowwise("a Linear layer on rows without a feature dim")
        weight, bias = mod.weight, mod.bias
        assert isinstance(weight, torch.Tensor)
        return _R(
            segment_linear(x.t, weight, bias if isinstance(bias, torch.Tensor) else None, seg)[0]
        )
    if mod._parameters or mod._buffers:
        raise _NotRowwise(f"a {kind.__name__} layer")
    if kind in _DROPOUT_MODULES:
        if mod.training and getattr(mod, "p", 0) > 0:
            raise _NotRowwise("dropout draws its masks per member in the loop")
        return x
    if kind in _ACTIVATION_MODULES:
        return _elementwise(mod, args, kwargs, seg)
    if kind is nn.Flatten and isinstance(x, _R):
        if _dim(mod.start_dim, x.t.dim()) == 0:
            raise _NotRowwise("Flatten over the rows")
        return _R(mod(x.t))
    if kind in (nn.Softmax, nn.LogSoftmax, nn.Softmin) and isinstance(x, _R):
        if mod.dim is None or _dim(mod.dim, x.t.dim()) == 0:
            raise _NotRowwise(f"{kind.__name__} over the rows")
        return _R(mod(x.t))
    raise _NotRowwise(f"a {kind.__name__} layer")


def _call(op: str, target: Any, args: Any, kwargs: Any, seg: Segments) -> Any:
    leaves = _leaves((args, kwargs))
    if not any(isinstance(v, (_R, _M)) for v in leaves):  # constants only: run as written
        if op == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        return target(*args, **kwargs)
    name = target if op == "call_method" else getattr(target, "__name__", repr(target))
    if target is operator.getitem:
        return _getitem(args[0], args[1])
    if target is getattr:
        obj, attr = args[0], args[1]
        if attr in ("device", "dtype", "is_cuda", "is_floating_point"):
            return getattr(obj.t, attr)
        if attr == "ndim" and isinstance(obj, _R):
            return obj.t.dim()
        raise _NotRowwise(f"the forward reads .{attr} of a tensor")
    if target in _MATMUL or target is F.linear:
        return _matmul(target, args, kwargs, seg)
    if op == "call_method":
        if target in ("dim", "size"):
            return _size(target, args, kwargs)
        if target in _ELEMENTWISE_METHODS:
            return _elementwise(lambda s, *a, **k: getattr(s, target)(*a, **k), args, kwargs, seg)
        if target in _DIM_METHODS:
            return _dimwise(target, lambda s, *a, **k: getattr(s, target)(*a, **k), args, kwargs)
        if target in ("transpose", "swapaxes", "permute"):
            return _transpose(target, args)
        raise _NotRowwise(f"the method .{name}()")
    if target in _ELEMENTWISE_FUNCTIONS:
        return _elementwise(target, args, kwargs, seg)
    if target in _DIM_FUNCTIONS:
        return _dimwise(target, target, args, kwargs)
    if target in _CAT:
        return _cat(target, args, kwargs)
    if target in (torch.transpose, torch.swapaxes, torch.permute):
        return _transpose(target, args)
    raise _NotRowwise(f"the function {name}")


def _size(target: str, args: Any, kwargs: Any) -> Any:
    obj = args[0]
    if not isinstance(obj, _R):
        raise _NotRowwise(f".{target}() of a member tensor")
    if target == "dim":
        return obj.t.dim()
    d = args[1] if len(args) > 1 else kwargs.get("dim")
    if d is None or _dim(d, obj.t.dim()) == 0:
        raise _NotRowwise("the forward reads the number of rows")
    return obj.t.size(d)


def _getitem(obj: Any, index: Any) -> Any:
    if isinstance(obj, (tuple, list)):
        if not isinstance(index, (int, slice)):
            raise _NotRowwise("a sequence indexed by a tensor")
        return obj[index]
    if isinstance(obj, _M):
        if any(isinstance(i, (torch.Tensor, _R, _M)) for i in _leaves(index)):
            raise _NotRowwise("a member tensor indexed by a tensor")
        rest = index if isinstance(index, tuple) else (index,)
        return _M(obj.t[(slice(None), *rest)])
    if not isinstance(obj, _R):
        raise _NotRowwise("indexing")
    idx = index if isinstance(index, tuple) else (index,)
    for i in idx:
        if not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool):
            raise _NotRowwise("rows indexed by a tensor")
    rank = obj.t.dim()
    if idx and isinstance(idx[0], slice) and idx[0] == slice(None):
        pass  # every row kept, in order
    elif idx and idx[0] is Ellipsis:
        rest = idx[1:]
        if Ellipsis in rest or sum(i is not None for i in rest) > rank - 1:
            raise _NotRowwise("an index over the rows")
    else:
        raise _NotRowwise("an index over the rows")
    return _R(obj.t[index])


def _dimwise(key: Any, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    position, name, default = (_DIM_METHODS if isinstance(key, str) else _DIM_FUNCTIONS)[key]
    obj = args[0]
    if not isinstance(obj, _R) or any(isinstance(v, (_R, _M)) for v in _leaves((args[1:], kwargs))):
        raise _NotRowwise(f"{getattr(key, '__name__', key)} on a member tensor")
    d = args[position] if len(args) > position else kwargs.get(name, default)
    if d is None:
        raise _NotRowwise(f"{getattr(key, '__name__', key)} over every dim, the rows included")
    rank = obj.t.dim() + (1 if key in _NEW_DIM else 0)
    dims = d if isinstance(d, (tuple, list)) else (d,)
    if any(_dim(x, rank) == 0 for x in dims):
        raise _NotRowwise(f"{getattr(key, '__name__', key)} over the rows")
    if key in (torch.flatten, "flatten"):
        end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
        _dim(end, rank)
    out = fn(obj.t, *args[1:], **kwargs)
    if isinstance(out, torch.Tensor):
        return _R(out)
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return tuple(_R(o) for o in out)
    raise _NotRowwise(f"{getattr(key, '__name__', key)} returned {type(out).__name__}")


def _transpose(key: Any, args: Any) -> Any:
    obj = args[0]
    if not isinstance(obj, _R):
        raise _NotRowwise("a transpose of a member tensor")
    rank = obj.t.dim()
    if key in ("permute", torch.permute):
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        if _dim(dims[0], rank) != 0:
            raise _NotRowwise("a permute that moves the rows")
        return _R(obj.t.permute(*dims))
    d0, d1 = args[1], args[2]
    if _dim(d0, rank) == 0 or _dim(d1, rank) == 0:
        raise _NotRowwise("a transpose that moves the rows")
    return _R(obj.t.transpose(d0, d1))


def _cat(key: Any, args: Any, kwargs: Any) -> Any:
    tensors = args[0]
    d = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, (tuple, list)) or not tensors:
        raise _NotRowwise("torch.cat of something other than a sequence")
    if not all(isinstance(t, _R) for t in tensors):
        raise _NotRowwise("torch.cat mixing rows with other tensors")
    rank = tensors[0].t.dim()
    if any(t.t.dim() != rank for t in tensors):
        raise _NotRowwise("torch.cat of row tensors of different ranks")
    if _dim(d, rank + (1 if key is torch.stack else 0)) == 0:
        raise _NotRowwise("torch.cat along the rows")
    return _R(key([t.t for t in tensors], d))


def _matmul(target: Any, args: Any, kwargs: Any, seg: Segments) -> Any:
    if target is F.linear:
        x = args[0]
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        if not isinstance(x, _R) or x.t.dim() < 2:
            raise _NotRowwise("F.linear on something other than the rows")
        if isinstance(w, _M) and (b is None or isinstance(b, _M)):
            if w.t.dim() != 3 or (b is not None and b.t.dim() != 2):
                raise _NotRowwise("F.linear with a weight that is not a matrix")
            return _R(segment_linear(x.t, w.t, None if b is None else b.t, seg)[0])
        if isinstance(w, torch.Tensor) and not isinstance(b, (_R, _M)):
            return _R(F.linear(x.t, w, b))
        raise _NotRowwise("F.linear mixing member and shared tensors")
    if kwargs or len(args) != 2:
        raise _NotRowwise("a matmul")
    a, b = args
    if not isinstance(a, _R) or a.t.dim() < 2:
        raise _NotRowwise("a matmul whose left operand is not the rows")
    if isinstance(b, _M) and b.t.dim() == 3:
        return _R(segment_linear(a.t, b.t.transpose(1, 2), None, seg)[0])
    if isinstance(b, torch.Tensor) and not isinstance(b, (_R, _M)) and b.dim() == 2:
        return _R(a.t @ b)
    raise _NotRowwise("a matmul with a right operand that is not a matrix")


# ------------------------------------------------------------------------------------ subsets


class _Remapped:
    """The loop's per-member attributes, keyed by the stack's member index in a subset call."""

    def __init__(self, attributes: PerMemberAttributes, members: list[int]) -> None:
        self.attributes, self.members = attributes, members

    def run(self, i: int, module: nn.Module, call: Any) -> Any:
        return self.attributes.run(self.members[i], module, call)


def subset_index(subset: Any, num_members: int) -> list[int]:
    """``subset=`` as a list of distinct member indices, checked, naming the fix."""
    where = f"{WHERE}: subset="
    if isinstance(subset, torch.Tensor):
        if subset.dim() != 1 or subset.is_floating_point() or subset.dtype == torch.bool:
            raise TypeError(
                f"{where} takes distinct member indices: a list of ints or a 1-D integer "
                f"tensor; got a tensor of dtype {subset.dtype} and shape {tuple(subset.shape)}. "
                f"To send each input row to its own member, use members=index."
            )
        chosen = subset.tolist()
    elif isinstance(subset, (list, tuple, range)):
        chosen = list(subset)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in chosen):
            raise TypeError(f"{where} takes distinct member indices (ints); got {subset!r}.")
    else:
        raise TypeError(
            f"{where} takes distinct member indices: a list of ints or a 1-D integer tensor; "
            f"got a {type(subset).__name__}."
        )
    if not chosen:
        raise ValueError(f"{where} is empty; name at least one member.")
    bad = [i for i in chosen if not 0 <= i < num_members]
    if bad:
        raise IndexError(
            f"{where} holds member index {bad[0]}, but the stack has {num_members} members "
            f"(indices 0 to {num_members - 1})."
        )
    if len(set(chosen)) != len(chosen):
        raise ValueError(
            f"{where} holds a member twice ({chosen}); give distinct members (to run a member "
            f"on several inputs, use members= routing)."
        )
    return chosen


def subset_view(view: StackView, chosen: list[int]) -> tuple[StackView, Callable[[], None]]:
    """A view of members ``chosen`` alone, and what writes their buffers back afterwards.

    Consecutive members are views of the stacked tensors (nothing copied); otherwise the
    parameters are gathered with ``index_select`` (gradients flow into those rows alone) and
    the buffers copied, to be written back after the call.
    """
    from phalanx.backends import StackView

    params, buffers = view.state()
    start, stop = chosen[0], chosen[-1] + 1
    if chosen == list(range(start, stop)):
        sub_params = {k: v[start:stop] for k, v in params.items()}
        sub_buffers = {k: v[start:stop] for k, v in buffers.items()}

        def write_back() -> None:
            return None
    else:
        device = next(iter({**params, **buffers}.values())).device if (params or buffers) else None
        idx = torch.tensor(chosen, device=device)
        sub_params = {k: v.index_select(0, idx) for k, v in params.items()}
        with torch.no_grad():
            sub_buffers = {k: v.index_select(0, idx) for k, v in buffers.items()}
        sent = {k: v.clone() for k, v in sub_buffers.items()} if buffers else {}

        def write_back() -> None:
            with torch.no_grad():
                for k, v in sub_buffers.items():
                    if not torch.equal(v, sent[k]):
                        buffers[k].index_copy_(0, idx, v)

    sub = StackView(len(chosen), view.module, view.template, lambda: (sub_params, sub_buffers))
    sub.lock = view.lock
    if view.generators is not None:
        sub.generators = view.generators.subset(chosen)
    sub.cache["auto"] = view.cache_of("auto")
    attributes = view.cache_of("loop").setdefault("attributes", PerMemberAttributes())
    sub.cache["loop"] = {"attributes": _Remapped(attributes, chosen)}
    return sub, write_back


def subset_segment(
    view: StackView,
    requested: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    in_dims: tuple[int | None, ...],
    chosen: list[int],
) -> Any:
    """A subset call on the segment path: member ``chosen[s]`` runs segment s, which holds
    the whole input (a shared input is repeated, a per-member one flattened); None where the
    segment path does not apply (then the backend runs the subset view)."""
    view.cache_of("routed")["last_path"] = "general"  # until the segment path has run
    if requested not in ("fused", "auto") or not args or torch.compiler.is_compiling():
        return None
    if not all(isinstance(a, torch.Tensor) and a.dim() >= (1 if d is None else 2)
               for a, d in zip(args, in_dims)):  # fmt: skip
        return None
    rows = {a.shape[0] if d is None else a.shape[1] for a, d in zip(args, in_dims)}
    if len(rows) != 1 or not (batch := rows.pop()):
        return None
    k = len(chosen)
    gathered = tuple(
        a.expand(k, *a.shape).reshape(k * batch, *a.shape[1:]) if d is None
        else a.reshape(k * batch, *a.shape[2:])
        for a, d in zip(args, in_dims)
    )  # fmt: skip
    device = gathered[0].device
    member_of = torch.tensor(chosen, device=device).repeat_interleave(batch)
    seg = Segments(chosen, [batch] * k, member_of, view.num_members)
    reason = _blocked(view, gathered, kwargs)
    if reason is not None:
        return None
    plan = _plan(view)
    signature = ("subset", *((a.dim(), a.dtype) for a in gathered))
    if isinstance(plan, str) or None in plan.refused or signature in plan.refused:
        return None
    try:
        out = _run(plan, view, gathered, seg)
    except _NotRowwise as e:
        plan.refused[signature] = str(e)
        return None
    view.cache_of("routed")["last_path"] = "segment"
    return pytree.tree_map(
        lambda t: t.view(k, batch, *t.shape[1:]) if isinstance(t, torch.Tensor) else t, out
    )
