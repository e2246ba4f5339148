"""The segment Linear: every sorted row through its own member's Linear, the kernel chosen by
shape (the member's own ``F.linear``, one ``bmm``, ``F.grouped_mm`` or one GEMM per segment),
and the rows' partition into member segments that the kernels read."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from phalanx import _torch_compat as compat
from phalanx.backends._bmm import linear_bmm, linear_ops
from phalanx.routed._checks import Routing


class NotRowwise(Exception):
    """The trace holds an operation the segment path does not prove row-wise."""


class Segments:
    """The sorted rows' partition into member segments, in the forms the kernels need.

    Attributes:
        members: the member of each segment, in row order (distinct).
        count_list: the rows of each segment.
        member_of: ``(R,)`` each row's member (not held by a one-segment ``Segments.one``).
        num_members: N.
    """

    def __init__(
        self,
        members: list[int],
        counts: list[int],
        member_of: torch.Tensor | None,
        num_members: int,
        views: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] | None = None,
    ) -> None:
        self.members, self.count_list, self._member_of = members, counts, member_of
        self.num_members = num_members
        self.rows = sum(counts)
        self.equal = len(set(counts)) == 1
        self.whole = members == list(range(num_members))
        self._index: torch.Tensor | None = None
        self._offsets: dict[int, torch.Tensor] = {}
        self._views = views

    @classmethod
    def of(cls, routing: Routing, num_members: int) -> Segments:
        members = [i for i, c in enumerate(routing.count_list) if c]
        counts = [routing.count_list[i] for i in members]
        return cls(members, counts, routing.member_of, num_members)

    @classmethod
    def one(
        cls,
        member: int,
        rows: int,
        num_members: int,
        views: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]],
    ) -> Segments:
        """One segment of ``rows`` rows, all member ``member``'s; the segments of one call
        share ``views`` (see ``member_slice``)."""
        return cls([member], [rows], None, num_members, views)

    @property
    def member_of(self) -> torch.Tensor:
        if self._member_of is None:
            raise RuntimeError("a one-segment Segments holds no per-row members")
        return self._member_of

    def member_slice(self, t: torch.Tensor, m: int) -> torch.Tensor:
        """Member ``m``'s slice of the stacked tensor ``t``. The per-segment runs of one call
        share one ``unbind`` per tensor, so that backward stacks the members' gradients in
        one pass (as the general path and the loop backend do) instead of one zero-filled
        full-size gradient per slice."""
        if self._views is None or not (t.requires_grad and torch.is_grad_enabled()):
            return t[m]
        got = self._views.get(id(t))
        if got is None:  # the tensor is kept with its views: its id stays its own
            got = self._views[id(t)] = (t, t.unbind(0))
        return got[1][m]

    def index(self, device: torch.device) -> torch.Tensor:
        if self._index is None:
            self._index = compat.from_host(self.members, torch.long, device)
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
            ends = compat.from_host(self.count_list, torch.long, device).mul_(inner).cumsum(0)
            self._offsets[inner] = ends.to(torch.int32)
        return [c * inner for c in self.count_list], self._offsets[inner]


_GROUPED_DTYPES = {torch.float32, torch.bfloat16, torch.float16}
GROUPED_ROWS = 512
GROUPED_SEGMENTS = 32
"""``F.grouped_mm`` runs a segment Linear from this many segments on, with up to
``GROUPED_ROWS`` rows per segment on average: many small GEMMs, where one call per segment
costs more in Python than in arithmetic. Elsewhere one GEMM per segment is as fast or faster
on the CPUs measured (benchmarks/notes/ROUTED.md)."""


PER_SEGMENT_ROWS = 128
PER_SEGMENT_MAX = 16
PER_SEGMENT_FEW = 8
"""The cost rule's other half: up to ``PER_SEGMENT_MAX`` segments of at least
``PER_SEGMENT_ROWS`` rows on average, or up to ``PER_SEGMENT_FEW`` segments of any size, run
the forward once per segment (``per_segment``)."""


def per_segment(segments: int, rows: int) -> bool:
    """Whether a routed or subset call runs its forward once per segment, the member's own
    operations on its rows (the loop's kernels: one GEMM per Linear, its parameters read as
    views, no per-row gathers of member tensors, each segment's intermediates in cache), rather
    than once over all rows (one ``bmm``, ``grouped_mm`` or a GEMM per segment inside each
    Linear, elementwise passes over every row).

    A static rule, from the shapes alone: the per-segment runs cost one pass of the traced
    forward's Python per segment, which only a few segments amortise; many or small segments
    run once over all rows, where one call per layer covers them. Segment sizes measured on
    this project's CPU (benchmarks/notes/ROUTED.md, "The cost rule"). A few segments run once each
    whatever their size: that is the loop's own work (its kernels, its launches), which the
    promise "never slower than the loop" is measured against, while the pass over all rows
    pays per-row gathers of member tensors and, below ``GROUPED_SEGMENTS``, one GEMM per
    segment in every Linear anyway (a PETS call, 5 members on 400 rows: 0.59x the loop over
    all rows, 0.72x per segment).
    """
    if segments <= 1 or segments > PER_SEGMENT_MAX:
        return False
    return segments <= PER_SEGMENT_FEW or rows >= PER_SEGMENT_ROWS * segments


_CAPABLE: dict[torch.device, bool] = {}


def _grouped_capable(device: torch.device) -> bool:
    """Whether ``F.grouped_mm`` runs on this CUDA device: compute capability >= 9.0."""
    if device not in _CAPABLE:
        _CAPABLE[device] = torch.cuda.get_device_capability(device) >= (9, 0)
    return _CAPABLE[device]


def _use_grouped(x: torch.Tensor, w: torch.Tensor, segments: int) -> bool:
    grouped = getattr(F, "grouped_mm", None)
    if grouped is None or x.dtype not in _GROUPED_DTYPES or w.dtype != x.dtype:
        return False
    if x.device.type == "cuda":
        # torch's CUDA grouped GEMM (CUTLASS) is built for compute capability 9.0 and later;
        # older GPUs take the per-segment path
        return x.dtype == torch.bfloat16 and _grouped_capable(x.device)
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
    def forward(
        ctx: Any,
        x: Any,
        w: Any,
        b: Any,
        seg: Any,
        counts: Any,
        offs: Any,
        member_of: Any,
        grouped: Any,
    ) -> Any:
        ctx.save_for_backward(x, w, b, offs, member_of)
        ctx.seg, ctx.counts, ctx.grouped = seg, counts, grouped
        return _segment_mm(x, w, b, seg, counts, offs, member_of, grouped)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
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
        raise NotRowwise(f"a Linear layer meets dtypes {x.dtype} and {w.dtype}")
    lead = x.shape[:-1]
    out_f = w.shape[1]
    graph = torch.is_grad_enabled() and (
        x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)
    )
    if graph:
        act = None
    if len(seg.members) == 1:
        m = seg.members[0]
        y = F.linear(x, seg.member_slice(w, m), None if b is None else seg.member_slice(b, m))
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
