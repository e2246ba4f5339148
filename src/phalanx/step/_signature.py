"""What a captured graph is specialised to, as a cache key: ``CompiledStep``'s own guard."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from phalanx import _torch_compat as compat
from phalanx._torch_compat import pytree

__all__ = ["HYPER_KEYS", "NoSignature", "data_key", "graph_constants", "value_key"]

HYPER_KEYS = ("lr", "member_lr", "betas", "eps", "weight_decay", "maximize")
"""The optimizer group keys whose values the step's hyperparameter tensors are built from."""


class NoSignature(Exception):
    """A value of this type cannot be a constant of a captured graph."""


class Held:
    """A tensor in a cache key: equal to another only if it is the same object at the same
    version. It holds the tensor, so its id cannot pass to a new tensor while the key lives
    (a key of ``id()`` alone went stale when a scheduler replaced the tensor twice)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor, self.version = tensor, compat.version(tensor)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Held)
            and other.tensor is self.tensor
            and other.version == self.version
        )

    __hash__ = None  # type: ignore[assignment]


def value_key(v: Any) -> Any:
    if isinstance(v, Tensor):
        return Held(v)
    if isinstance(v, tuple):
        return tuple(value_key(x) for x in v)
    return v


def data_key(args: tuple, target: Any) -> tuple:
    """The inputs and the target as a key: tensors as shape, strides, dtype and device, never
    as objects (a key holding them would keep every call's data alive); a target may be a
    tuple, list or dict of tensors.

    Raises:
        NoSignature: a value that cannot be a graph constant (named by its type).
    """

    def sig(a: Any) -> Any:
        if isinstance(a, Tensor):
            return (a.shape, a.stride(), a.dtype, a.device, a.requires_grad)
        if a is None or isinstance(a, bool | int | float | str | torch.dtype):
            return (type(a), a)
        raise NoSignature(type(a).__name__)

    leaves, spec = pytree.tree_flatten(target)
    return (*map(sig, args), spec, *map(sig, leaves))


def graph_constants(
    stack: Any, opt: Any, params: list[Tensor], groups: dict[int, dict[str, Any]]
) -> tuple:
    """What the graph holds as constants besides the data: what the rule's update branches
    on, the state it reads (SGD's buffer starts when its momentum does), and the members'
    dropout rates (a rate set by ``stack[i] = module`` or a checkpoint load is a new graph;
    empty where the members share them). The stack's backend is not part of it: every
    backend is exact, and the graph keeps the one the stack ran when it was traced."""
    rule = (
        *(tuple(sorted(opt.options(g).items())) for g in opt.param_groups),
        *(tuple(opt.ensure_state(groups[id(p)], p)) for p in params if p.requires_grad),
    )
    rates = getattr(stack, "dropout_rates", {})
    rates = tuple((k, tuple(v.tolist())) for k, v in rates.items()) if rates else ()
    return rule, rates
