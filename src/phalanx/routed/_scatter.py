"""The per-segment runs' outputs put back in the input's order (``scatter``): each segment's
rows copied into their places (unweighted, nothing dropped) or added into zeros (weighted, or
with dropped entries).

Where an autograd graph is recorded, the copies are one autograd node per output
(``_PutRows``), whose backward hands each segment the gradient of its own rows
(``index_select``, the loop's ``out[rows] = y`` backward). A chain of in-place
``index_copy_`` calls, one per segment, would record one node per segment, and each node's
backward also makes the gradient for the output as it was before its copy (a clone of the
whole output gradient with the copied rows zeroed: ``index_fill``): S - 1 copies of the
full gradient for S segments, in every training step (PETS: 7 members, two (10000, 12)
outputs, 12 such copies a step).
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.routed._checks import Routing
from phalanx.routed._general import columns_of, concat
from phalanx.routed._segments import Segments


class _PutRows(torch.autograd.Function):
    """``out[entries[s]] = ts[s]`` for every segment s into a new ``(size, ...)`` output,
    every row written once (the entries of all segments are a permutation of
    ``0..size-1``); backward: segment s's gradient is the output gradient's rows
    ``entries[s]``, with differentiable operations (second derivatives flow)."""

    @staticmethod
    def forward(ctx: Any, entries: list[torch.Tensor], size: int, *ts: torch.Tensor) -> Any:
        ctx.entries = entries
        t0 = ts[0]
        out = t0.new_empty(size, *t0.shape[1:])
        for e, t in zip(entries, ts):
            out.index_copy_(0, e, t)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return None, None, *(g.index_select(0, e) for e in ctx.entries)


def scatter(outputs: list[Any], routing: Routing, seg: Segments) -> Any:
    """The segments' outputs (segment order) in the input's order: ``(B, ...)`` with
    weights (each row the weighted sum of its k outputs, in member order, added into
    zeros), ``(B, k, ...)`` or ``(B, ...)`` without (copied into place, as the loop's
    ``out[rows] = y``); dropped entries zero."""
    columns, rebuild = columns_of(outputs)
    weights = None if routing.weights is None else routing.weights.reshape(-1)
    k, rows = routing.k, routing.rows
    summed = weights is not None
    covered = not summed and routing.total == rows * k  # each output row written once
    graph = torch.is_grad_enabled()
    size = rows if summed else rows * k
    starts = [0]  # each segment's first entry
    for c in seg.count_list:
        starts.append(starts[-1] + c)
    joined = []
    for column in columns:
        t0 = column[0]
        if not isinstance(t0, torch.Tensor):
            joined.append(concat(column, seg.count_list))  # equal values, else its error
            continue
        for t, c in zip(column, seg.count_list):
            if t.dim() == 0 or t.shape[0] != c:
                concat(column, seg.count_list)  # raises the error naming the shapes
        if covered and graph and any(t.requires_grad for t in column):
            rows_of = [routing.entries.narrow(0, s, c) for s, c in zip(starts, seg.count_list)]
            out = _PutRows.apply(rows_of, size, *column)
        elif covered:  # the segments joined, then copied into place in one call
            out = t0.new_empty(size, *t0.shape[1:])
            out.index_copy_(0, routing.entries, torch.cat(column))
        else:
            out = (t0.new_empty if covered else t0.new_zeros)(size, *t0.shape[1:])
            for t, start, c in zip(column, starts, seg.count_list):
                entries = routing.entries.narrow(0, start, c)
                if summed:
                    assert weights is not None
                    w = weights.index_select(0, entries).to(t.dtype)
                    t = t * w.view(-1, *(1,) * (t.dim() - 1))
                    entries = routing.source_rows.narrow(0, start, c)
                if covered:
                    out.index_copy_(0, entries, t)  # the loop's out[rows] = y, no zero fill
                else:
                    out.index_add_(0, entries, t)
        if not summed and routing.index.dim() == 2:
            out = out.view(rows, k, *t0.shape[1:])
        joined.append(out)
    return rebuild(joined)
