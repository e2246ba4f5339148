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

The files: ``_checks`` (the arguments, the sort into segments), ``_general`` (the general
path), ``_segments`` (the segment Linear and its kernels), ``_rowwise`` (the fx proof and its
steps), ``_rowwise_ops`` (the operations allowed on rows), ``_scatter`` (the per-segment
outputs put back in the input's order), ``_subsets`` (``subset=``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from phalanx._torch_compat import pytree
from phalanx.routed._checks import Routing, routed_inputs, routing_from, subset_index
from phalanx.routed._general import general_path
from phalanx.routed._rowwise import segment_path
from phalanx.routed._subsets import subset_segment, subset_view

if TYPE_CHECKING:
    from phalanx.backends import StackView

__all__ = ["routed_forward", "subset_index", "subset_segment", "subset_view"]


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
    cache = view.cache_of("routed")
    compiling = torch.compiler.is_compiling()  # a trace keeps no routing between calls
    routing = routing_from(
        members, weights, rows, view.num_members, device, None if compiling else cache
    )
    ran = None
    batched = requested in ("fused", "auto") and view.generators is None  # own generators: loop
    if batched and routing.total and not compiling:
        ran = segment_path(view, requested, args, kwargs, routing)
    cache["last_path"] = "segment" if ran is not None else "general"  # for tests and benches
    if ran is None:
        return _combine(general_path(view, routing.gather(args), kwargs, routing), routing)
    out, combined = ran
    return out if combined else _combine(out, routing)


def _combine(out: Any, routing: Routing) -> Any:
    """Sorted outputs back in the input's order; with weights, summed over the k choices."""
    total_entries = routing.rows * routing.k
    dropped = routing.keep is not None and routing.total < total_entries
    in_order = routing.in_order  # the sorted rows are the input's: nothing to put back
    if not dropped and not in_order:
        inverse = torch.empty_like(routing.entries)
        inverse[routing.entries] = torch.arange(routing.total, device=inverse.device)

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if dropped:  # dropped entries contribute zero
            full = t.new_zeros(total_entries, *t.shape[1:])
            y = full.index_copy(0, routing.entries, t)
        elif in_order:
            y = t
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
