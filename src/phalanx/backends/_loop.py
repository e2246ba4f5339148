"""The reference backend: member by member, on views of the stacked tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call

from phalanx import _torch_compat as compat
from phalanx._torch_compat import pytree
from phalanx.backends._keywords import member_kwargs
from phalanx.backends._recompute import MemberRecompute
from phalanx.backends._state import PerMemberAttributes

if TYPE_CHECKING:
    from phalanx.backends import StackView


def stack_outputs(outputs: list[Any], where: str) -> Any:
    """Stacks N member outputs (tensors, tuples, dicts of tensors) along a new dim 0."""
    flat0, spec0 = pytree.tree_flatten(outputs[0])
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


class LoopBackend:
    """Runs ``functional_call`` once per member on views ``tensor[i]`` of the stacked tensors.

    Gradients flow into the stacked parameters through the views; in-place buffer updates
    (BatchNorm running statistics) land in the stacked buffers. This is the specification that
    every other backend is tested against.
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
        # unbind gives all N views in one autograd node, so backward builds one stacked grad
        # instead of N zero-padded ones.
        param_views = {k: v.unbind(0) for k, v in params.items()}
        attributes = view.cache_of("loop").setdefault("attributes", PerMemberAttributes())
        shared = [
            (k, a, compat.version(a))
            for k, (a, d) in enumerate(zip(args, in_dims))
            if d is None and isinstance(a, torch.Tensor)
        ]
        recompute = MemberRecompute(view.module, attributes)
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
            # A checkpointed region in the member's forward recomputes as member i.
            outputs.append(
                recompute.run(
                    i,
                    state,
                    (member_args, member_kw),
                    lambda: attributes.run(i, view.module, call),  # noqa: B023
                )
            )
            if i == 0 and shared:
                originals = {k: before[k] for k, a, v in shared if compat.version(a) != v}
                del before
        return stack_outputs(outputs, "Stack.forward()")


BACKEND = LoopBackend()
