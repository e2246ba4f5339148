"""What a captured graph is specialised to, as a cache key: ``CompiledStep``'s own guard."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from phalanx import _torch_compat as compat

__all__ = ["HYPER_KEYS", "NoSignature", "value_key"]

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
