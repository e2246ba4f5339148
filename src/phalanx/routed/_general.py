"""The general path of a routed call: each member's own ``forward`` on its own segment of the
sorted rows, as the loop over members runs it (any architecture)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call

from phalanx import _torch_compat as compat
from phalanx._torch_compat import pytree
from phalanx.backends._loop import check_writes, member_rows, writable
from phalanx.backends._outputs import refuse_opaque
from phalanx.backends._state import PerMemberAttributes
from phalanx.routed._checks import WHERE, Routing

if TYPE_CHECKING:
    from phalanx.backends import StackView


def general_path(
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
    written = False  # a member wrote into its rows of the gathered inputs
    versions_in = [compat.version(a) if isinstance(a, torch.Tensor) else 0 for a in gathered]
    for i, count in segments:
        state = {k: v[i] for k, v in param_views.items()}
        # Each member's buffer rows with a version counter of their own (as its own buffers
        # have): a view's is the stacked buffer's, so member 2 updating its step counter
        # would invalidate what member 0 saved of its own for backward.
        state.update({k: v[i] if v.requires_grad else v.data[i] for k, v in buffers.items()})
        member_args = tuple(
            a.narrow(0, start, count) if isinstance(a, torch.Tensor) else a for a in gathered
        )
        if written:  # rows of their own, for the same reason
            member_args = tuple(
                a.clone() if isinstance(a, torch.Tensor) else a for a in member_args
            )
        start += count
        call = lambda: functional_call(view.module, state, member_args, kwargs)  # noqa: B023, E731
        if view.generators is not None:  # member i draws from its own generators
            call = partial(view.generators.run, i, call)
        if view.rates is not None:  # member i's own dropout rates
            call = partial(view.rates.run, i, call)
        versions = {k: compat.version(state[k]) for k in tracked}
        outputs.append(attributes.run(i, view.module, call))
        check_writes(i, params, state, versions)
        written = written or any(
            isinstance(a, torch.Tensor) and compat.version(a) != v
            for a, v in zip(gathered, versions_in)
        )
    return concat(outputs, [c for _, c in segments])


def _plain(out: Any) -> int | None:
    """-1 for a tensor output, n for a plain tuple of n tensors, else None (a pytree)."""
    if isinstance(out, torch.Tensor):
        return -1
    if type(out) is tuple and all(isinstance(t, torch.Tensor) for t in out):
        return len(out)
    return None


def columns_of(outputs: list[Any]) -> tuple[list[list[Any]], Any]:
    """The members' outputs leaf by leaf (``columns[j][s]``: leaf j of segment s) and a
    function that rebuilds the structure from one value per leaf. A tensor or a plain tuple
    of tensors, the same for every segment, needs no pytree walk (a few microseconds a
    segment, which the loop over members does not pay)."""
    kind = _plain(outputs[0])
    if kind is not None and all(_plain(out) == kind for out in outputs[1:]):
        if kind == -1:
            return [list(outputs)], lambda leaves: leaves[0]
        return [list(col) for col in zip(*outputs)], tuple
    flat0, spec0 = pytree.tree_flatten(outputs[0])
    refuse_opaque(flat0, WHERE)
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
    return columns, lambda leaves: pytree.tree_unflatten(leaves, spec0)


def concat(outputs: list[Any], counts: list[int]) -> Any:
    """The members' segment outputs joined along dim 0, leaf by leaf."""
    columns, rebuild = columns_of(outputs)
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
    return rebuild(joined)
