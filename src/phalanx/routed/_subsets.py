"""``subset=`` calls: some members alone, as a view of the stack (the backend runs it) or on
the segment path (each chosen member's segment holds the whole input)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from phalanx import _torch_compat as compat
from phalanx._module_tree import meta_copy
from phalanx._torch_compat import pytree
from phalanx.backends._state import PerMemberAttributes, RemappedAttributes
from phalanx.routed._direct import MemberViews
from phalanx.routed._rowwise import NotRowwise, checked_plan, direct_of, run_plan
from phalanx.routed._segments import Segments, per_segment

if TYPE_CHECKING:
    from phalanx.backends import StackView


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
        idx = compat.from_host(chosen, torch.long, device)
        sub_params = {k: v.index_select(0, idx) for k, v in params.items()}
        with torch.no_grad():
            sub_buffers = {k: v.index_select(0, idx) for k, v in buffers.items()}
        sent = {k: v.clone() for k, v in sub_buffers.items()} if buffers else {}

        def write_back() -> None:
            # Only the buffers the members changed are written back (an in-place write of
            # an unchanged buffer could break a backward that saved it), found with one host
            # read for all of them rather than one torch.equal each.
            names = list(sub_buffers)
            if not names:
                return
            with torch.no_grad():
                changed = torch.stack(
                    [
                        (sub_buffers[k] != sent[k]).any()
                        if sub_buffers[k].shape == sent[k].shape
                        else sent[k].new_ones((), dtype=torch.bool)
                        for k in names
                    ]
                ).tolist()
                for k, c in zip(names, changed, strict=True):
                    if c:
                        buffers[k].index_copy_(0, idx, sub_buffers[k])

    sub = StackView(len(chosen), view.module, view.template, lambda: (sub_params, sub_buffers))
    sub.lock = view.lock
    if view.generators is not None:
        sub.generators = view.generators.subset(chosen)
    if view.rates is not None:
        sub.rates = view.rates.subset(chosen)
    sub.cache["auto"] = view.cache_of("auto")
    attributes = view.cache_of("loop").setdefault("attributes", PerMemberAttributes())
    sub.cache["loop"] = {"attributes": RemappedAttributes(attributes, chosen)}
    return sub, write_back


def _writes_inputs(
    plan: Any, view: StackView, args: tuple[Any, ...], kwargs: dict[str, Any],
    in_dims: tuple[int | None, ...],
) -> bool:  # fmt: skip
    """Whether the member's forward writes a positional input in place, found once per plan
    by running it on ``meta`` copies: torch.fx records ``x /= 2`` as ``x = x / 2``, so the
    trace cannot tell, and the segment path would leave the caller's input unwritten where
    the backends write it once. Where the probe fails, assume it writes (the backend runs)."""
    if plan.writes_inputs is None:
        metas = [
            torch.empty_like(a if d is None else a[0], device="meta")
            if isinstance(a, torch.Tensor) else a
            for a, d in zip(args, in_dims)
        ]  # fmt: skip
        versions = [compat.version(m) if isinstance(m, torch.Tensor) else 0 for m in metas]
        meta_kwargs = {
            k: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()
        }
        try:
            with torch.no_grad():
                meta_copy(view.template)(*metas, **meta_kwargs)  # one member, a copy
        except Exception:  # a probe: any failure means "cannot tell"
            plan.writes_inputs = True
        else:
            plan.writes_inputs = any(
                isinstance(m, torch.Tensor) and compat.version(m) != v
                for m, v in zip(metas, versions)
            )
    return bool(plan.writes_inputs)


def subset_segment(
    view: StackView,
    requested: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    in_dims: tuple[int | None, ...],
    chosen: list[int],
) -> Any:
    """A subset call on the segment path, or None where it does not apply (then the backend
    runs the subset view). By the cost rule (``per_segment``), either member ``chosen[s]``
    runs once on its own input (the shared input itself, a per-member input's slice ``s``:
    views, nothing gathered), the outputs stacked; or once over all rows, segment s holding
    the whole input (a shared input repeated, a per-member one flattened)."""
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
    plan = checked_plan(view, args, kwargs)
    signature = ("subset", *((a.dim() - (d is not None), a.dtype) for a, d in zip(args, in_dims)))
    if isinstance(plan, str) or None in plan.refused or signature in plan.refused:
        return None
    if _writes_inputs(plan, view, args, kwargs, in_dims):
        return None  # the backend writes a shared input once, as an unrouted call does
    try:
        if k == 1 or per_segment(k, k * batch):
            direct = direct_of(plan, view, signature)
            if all(d is None for d in in_dims):  # the shared inputs themselves
                own = [args] * k
            else:
                own = [tuple(a if d is None else a[s] for a, d in zip(args, in_dims))
                       for s in range(k)]  # fmt: skip
            if direct is not None:  # the member's forward as one generated function
                member_views = MemberViews(direct, chosen, view.num_members)
                outs = [member_views.run(m, inputs) for m, inputs in zip(chosen, own)]
            else:
                views: dict[int, Any] = {}
                outs = [
                    run_plan(plan, view, inputs, Segments.one(m, batch, view.num_members, views))
                    for m, inputs in zip(chosen, own)
                ]
            if all(isinstance(o, torch.Tensor) for o in outs):
                out = torch.stack(outs)
            else:
                out = pytree.tree_map(
                    lambda *ts: torch.stack(ts) if isinstance(ts[0], torch.Tensor) else ts[0],
                    *outs,
                )
        else:
            gathered = tuple(
                a.expand(k, *a.shape).reshape(k * batch, *a.shape[1:]) if d is None
                else a.reshape(k * batch, *a.shape[2:])
                for a, d in zip(args, in_dims)
            )  # fmt: skip
            member_of = compat.from_host(chosen, torch.long, gathered[0].device).repeat_interleave(
                batch
            )
            seg = Segments(chosen, [batch] * k, member_of, view.num_members)
            out = pytree.tree_map(
                lambda t: t.view(k, batch, *t.shape[1:]) if isinstance(t, torch.Tensor) else t,
                run_plan(plan, view, gathered, seg),
            )
    except NotRowwise as e:
        plan.refused[signature] = str(e)
        return None
    plan.proven.add(signature)
    view.cache_of("routed")["last_path"] = "segment"
    return out
