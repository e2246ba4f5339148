"""The reference backend: member by member, on views of the stacked tensors."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call

from phalanx import _torch_compat as compat
from phalanx._torch_compat import pytree
from phalanx.backends._keywords import member_kwargs
from phalanx.backends._outputs import refuse_opaque
from phalanx.backends._recompute import MemberRecompute
from phalanx.backends._state import PerMemberAttributes

if TYPE_CHECKING:
    from phalanx.backends import StackView


def stack_outputs(outputs: list[Any], where: str) -> Any:
    """Stacks N member outputs (tensors, tuples, dicts of tensors) along a new dim 0."""
    flat0, spec0 = pytree.tree_flatten(outputs[0])
    refuse_opaque(flat0, where)
    columns: list[list[Any]] = [[leaf] for leaf in flat0]
    for i, out in enumerate(outputs[1:], start=1):
        flat, spec = pytree.tree_flatten(out)
        if spec != spec0:
            raise RuntimeError(
                f"{where}: member {i} returned an output of another structure than member 0 "
                f"({spec} against {spec0}); members must return the same structure."
            )
        for col, leaf in zip(columns, flat):
            col.append(leaf)
    stacked = [
        torch.stack(col) if isinstance(col[0], torch.Tensor) else _same_or_raise(col, where)
        for col in columns
    ]
    return pytree.tree_unflatten(stacked, spec0)


def _same_or_raise(values: list[Any], where: str) -> Any:
    if any(v != values[0] for v in values[1:]):
        raise RuntimeError(
            f"{where}: the members returned different non-tensor values ({values[0]!r}, ...); "
            f"only tensor outputs can be stacked."
        )
    return values[0]


class _Rows(torch.autograd.Function):
    """The N rows of one stacked parameter, each a tensor of its own that a member may write.

    ``unbind`` would give views that autograd forbids writing in place (they come from one
    function returning several views), and a view of any kind shares its version counter with
    the other members' rows, so member 1 clipping its weight would invalidate what member 0
    saved for backward. Each row here shares the stacked tensor's memory (a write lands in
    the stacked parameter, as the member's write lands in its own) with a version counter of
    its own; backward stacks the N gradients in one node, as ``unbind``'s does.
    """

    @staticmethod
    def forward(ctx: Any, stacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(row.data for row in stacked.unbind(0))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
        return torch.stack(grads)


def member_rows(params: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
    """Member i's parameters at ``[i]``: writable rows where autograd records the forward,
    ``unbind`` views otherwise (no graph, inside a torch.func transform, or while
    ``torch.compile``, ``torch.export`` or ``make_fx`` traces, which cannot follow ``.data``)."""
    if (
        not torch.is_grad_enabled()
        or compat.transforms_active()
        or compat.forward_ad_active()
        or compat.tracing()
    ):
        return {k: v.unbind(0) for k, v in params.items()}
    return {k: _Rows.apply(v) if v.requires_grad else v.unbind(0) for k, v in params.items()}


def writable(row: torch.Tensor) -> bool:
    return isinstance(row.grad_fn, _Rows._backward_cls)


def check_writes(
    i: int,
    params: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    versions: dict[str, int],
) -> None:
    """After member i ran: a parameter it wrote in place is announced to autograd through the
    stacked tensor; one written with grad enabled raises, as it does on the member alone."""
    for name, v in versions.items():
        row = state[name]
        if compat.version(row) == v:
            continue
        if writable(row):
            torch.autograd.graph.increment_version(params[name])
            continue
        raise RuntimeError(
            f"Stack.forward(): member {i}'s forward wrote into its parameter {name!r} in place "
            f"with grad enabled: a leaf Variable that requires grad is being used in an "
            f"in-place operation (the member alone raises so too). Write it under "
            f"torch.no_grad()."
        )


class LoopBackend:
    """Runs ``functional_call`` once per member on views ``tensor[i]`` of the stacked tensors.

    Gradients flow into the stacked parameters through the views; in-place buffer updates
    (BatchNorm running statistics) and in-place writes of a member's own weights
    (``Embedding(max_norm=...)``, ``weight.clamp_()`` under ``no_grad``) land in the stacked
    tensors. This is the specification that every other backend is tested against.
    """

    name = "loop"

    def forward(
        self,
        view: StackView,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: tuple[int | None, ...],
        kw_dims: frozenset[str] = frozenset(),
    ) -> Any:
        params, buffers = view.state()
        # One autograd node per stacked parameter gives all N rows, so backward builds one
        # stacked grad instead of N zero-padded ones.
        param_views = member_rows(params)
        tracked = {k for k, rows in param_views.items() if rows and writable(rows[0])}
        attributes = view.cache_of("loop").setdefault("attributes", PerMemberAttributes())
        shared = [
            (k, a, compat.version(a))
            for k, (a, d) in enumerate(zip(args, in_dims))
            if d is None and isinstance(a, torch.Tensor)
        ]
        recompute = MemberRecompute(view.module, attributes, view.rates)
        originals: dict[int, torch.Tensor] = {}
        outputs = []
        for i in range(view.num_members):
            state = {k: v[i] for k, v in param_views.items()}
            state.update({k: v[i] for k, v in buffers.items()})
            member_args = tuple(a[i] if d == 0 else a for a, d in zip(args, in_dims))
            if originals:  # member 0 wrote into a shared input: each member sees it as given
                member_args = tuple(
                    originals[k].clone() if k in originals else a for k, a in enumerate(member_args)
                )
            elif i == 0 and shared:
                with torch.no_grad():
                    before = {k: a.clone() for k, a, _ in shared}
            member_kw = member_kwargs(kwargs, kw_dims, i)
            call = lambda: functional_call(view.module, state, member_args, member_kw)  # noqa: B023, E731
            if view.generators is not None:  # member i draws from its own generators
                call = partial(view.generators.run, i, call)
            if view.rates is not None:  # member i's own dropout rates
                call = partial(view.rates.run, i, call)
            # A checkpointed region in the member's forward recomputes as member i.
            versions = {k: compat.version(state[k]) for k in tracked}
            outputs.append(
                recompute.run(
                    i,
                    state,
                    (member_args, member_kw),
                    lambda: attributes.run(i, view.module, call),  # noqa: B023
                )
            )
            check_writes(i, params, state, versions)
            if i == 0 and shared:
                originals = {k: before[k] for k, a, v in shared if compat.version(a) != v}
                del before
        return stack_outputs(outputs, "Stack.forward()")


BACKEND = LoopBackend()
