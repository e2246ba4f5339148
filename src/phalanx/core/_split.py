"""Sliced input: one wide tensor whose slices along a dimension belong to the members."""

from __future__ import annotations

import torch


def split(x: torch.Tensor, num_members: int, dim: int = 1) -> torch.Tensor:
    """Cuts ``x`` into ``num_members`` equal slices along ``dim`` and stacks them first.

    Member i gets slice ``x[..., i*d:(i+1)*d, ...]`` along ``dim``, where
    ``d = x.shape[dim] // num_members``. The result is a view of ``x`` whenever its strides
    allow (always for a contiguous ``x``), so no data is copied.

    Args:
        x: the wide input, e.g. ``(B, N * d)``.
        num_members: N, the number of members.
        dim: the dimension holding the N slices.

    Returns:
        ``(N, B, d)`` for ``x`` of shape ``(B, N * d)`` and ``dim=1``; in general ``x`` with
        ``dim`` split into ``(N, d)`` and the member axis moved to the front.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by ``num_members``.

    Example:
        >>> x = torch.randn(32, 20 * 400)
        >>> phalanx.split(x, 400, dim=1).shape
        torch.Size([400, 32, 20])
    """
    if not isinstance(num_members, int) or isinstance(num_members, bool) or num_members < 1:
        raise ValueError(
            f"phalanx.split(): num_members must be a positive int, got {num_members!r}."
        )
    if x.dim() == 0:
        raise ValueError("phalanx.split(): cannot split a 0-dimensional tensor.")
    d = dim % x.dim()
    width = x.shape[d]
    if width % num_members:
        raise ValueError(
            f"phalanx.split(): dimension {dim} of the input has size {width}, which is not "
            f"divisible by {num_members} members (input shape {tuple(x.shape)}). Each member "
            f"needs a slice of the same width: pad the input or check num_members."
        )
    return x.unflatten(d, (num_members, width // num_members)).movedim(d, 0)


def merge(xs: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`split`: lays the members' slices side by side along ``dim``.

    Args:
        xs: ``(N, B, d)``; in general the member axis first.
        dim: the dimension of the result that holds the N slices.

    Returns:
        ``(B, N * d)`` for ``xs`` of shape ``(N, B, d)`` and ``dim=1``. ``merge(split(x, N,
        dim), dim)`` equals ``x``. A copy is made only when the layout requires one.

    Example:
        >>> y = torch.randn(400, 32, 1)   # one output column per member
        >>> phalanx.merge(y, dim=1).shape
        torch.Size([32, 400])
    """
    if xs.dim() < 2:
        raise ValueError(
            f"phalanx.merge(): expected the member axis first and at least one more dimension, "
            f"got a tensor of shape {tuple(xs.shape)}."
        )
    d = dim % (xs.dim() - 1)
    return xs.movedim(0, d).flatten(d, d + 1)
