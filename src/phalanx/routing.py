"""Routing helpers for routed stacks: top-k choices from router logits, capacity limits,
per-member loads.

A routed call sends each input row to its own member(s)::

    index, weights = phalanx.routing.top_k(router_logits, k=2)     # (B, 2) each
    y = experts(x, members=index, weights=weights)                  # (B, H): a MoE layer

    d = phalanx.routing.dispatch(index, len(experts), weights=weights, capacity=64)
    y = experts(x, members=d)          # entries over a member's capacity are dropped (zero)
    d.dropped, d.overflow, d.load      # how many were dropped, per member; the kept loads

Everything here is ordinary differentiable torch code: the router's logits get gradients
through the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Dispatch", "dispatch", "load", "load_balancing_loss", "top_k"]


def top_k(
    logits: torch.Tensor, k: int, *, softmax: bool = True, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k best members and their weights, as Mixtral's router computes them.

    Args:
        logits: ``(B, N)`` router logits.
        k: members per row.
        softmax: weights from a softmax over all N members (computed in float32 at least,
            as transformers' Mixtral does), else the raw logits of the chosen members.
        normalize: rescale each row's k weights to sum to 1.

    Returns:
        ``(index, weights)``, both ``(B, k)``: long member indices (best first) and weights in
        the logits' dtype; pass them as ``stack(x, members=index, weights=weights)``.
    """
    if logits.dim() != 2:
        raise ValueError(
            f"phalanx.routing.top_k(): logits must be (B, N); got shape {tuple(logits.shape)}."
        )
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(
            f"phalanx.routing.top_k(): k={k} must be between 1 and the {logits.shape[1]} members."
        )
    if softmax:
        probs = F.softmax(logits, dim=1, dtype=torch.promote_types(logits.dtype, torch.float32))
        weights, index = torch.topk(probs, k, dim=-1)
    else:
        weights, index = torch.topk(logits, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return index, weights.to(logits.dtype)


def load(index: torch.Tensor, num_members: int) -> torch.Tensor:
    """``(N,)``: how many routed entries each member gets (over all rows and choices)."""
    return torch.bincount(index.reshape(-1).long(), minlength=num_members)


@dataclass
class Dispatch:
    """A routing with capacity limits applied; pass it as ``stack(x, members=dispatch)``.

    Attributes:
        index: ``(B,)`` or ``(B, k)`` member indices, as given.
        weights: the weights, as given (or None).
        keep: bool, the index's shape: False where the entry was dropped (over capacity).
        capacity: the per-member limit used (None: unlimited).
        counts: ``(N,)`` entries routed to each member, before dropping.
        load: ``(N,)`` entries each member runs, after dropping.
        overflow: ``(N,)`` entries dropped per member (``counts - load``).
        dropped: the number of entries dropped, an int.
        dropped_rows: the number of rows all of whose entries were dropped (their output is
            zero), an int.
    """

    index: torch.Tensor
    weights: torch.Tensor | None
    keep: torch.Tensor
    capacity: int | None
    counts: torch.Tensor
    load: torch.Tensor
    overflow: torch.Tensor
    dropped: int
    dropped_rows: int

    def fraction(self) -> torch.Tensor:
        """``(N,)``: each member's share of the kept entries."""
        return self.load.double() / max(1, int(self.load.sum()))


def dispatch(
    index: torch.Tensor,
    num_members: int,
    *,
    weights: torch.Tensor | None = None,
    capacity: int | None = None,
    capacity_factor: float | None = None,
) -> Dispatch:
    """Applies a capacity limit to a routing and reports the loads.

    Each member runs at most ``capacity`` entries (or ``ceil(capacity_factor * B * k / N)``).
    Entries compete for a member's capacity by choice first, then by row: every row's first
    choice before any second choice (as GShard and Switch do), rows in order within a choice.
    Dropped entries contribute zero to their row's output.

    Args:
        index: ``(B,)`` or ``(B, k)`` integer member indices.
        num_members: N.
        weights: optional weights of the index's shape, kept in the result.
        capacity: the per-member limit.
        capacity_factor: the limit as a multiple of an even share, instead of ``capacity``.
    """
    where = "phalanx.routing.dispatch()"
    if index.dim() not in (1, 2) or index.is_floating_point() or index.dtype == torch.bool:
        raise ValueError(
            f"{where}: index must be a (B,) or (B, k) integer tensor; got dtype {index.dtype} "
            f"and shape {tuple(index.shape)}."
        )
    if capacity is not None and capacity_factor is not None:
        raise ValueError(f"{where}: give capacity or capacity_factor, not both.")
    index = index.long()
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= num_members):
        raise IndexError(
            f"{where}: index holds an entry outside the {num_members} members (0 to "
            f"{num_members - 1})."
        )
    if capacity_factor is not None:
        capacity = _math_ceil(capacity_factor * index.numel() / num_members)
    if capacity is not None and capacity < 0:
        raise ValueError(f"{where}: capacity must be >= 0; got {capacity}.")
    counts = load(index, num_members)
    two_d = index if index.dim() == 2 else index.unsqueeze(1)
    if capacity is None:
        keep = torch.ones_like(index, dtype=torch.bool)
    else:
        priority = two_d.t().reshape(-1)  # choice-major: all first choices, then seconds
        order = torch.argsort(priority, stable=True)
        starts = counts.cumsum(0) - counts
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device) - starts[priority[order]]
        keep = (rank < capacity).view(two_d.shape[1], two_d.shape[0]).t().reshape(index.shape)
    kept = torch.bincount(index[keep], minlength=num_members)
    keep2 = keep if keep.dim() == 2 else keep.unsqueeze(1)
    return Dispatch(
        index=index,
        weights=weights,
        keep=keep,
        capacity=capacity,
        counts=counts,
        load=kept,
        overflow=counts - kept,
        dropped=int((~keep).sum()),
        dropped_rows=int((~keep2.any(1)).sum()) if index.shape[0] else 0,
    )


def _math_ceil(x: float) -> int:
    return int(-(-x // 1))


def load_balancing_loss(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss ``N * sum_i f_i * P_i``: ``f_i`` the fraction
    of routed entries member i gets, ``P_i`` its mean router probability. 1 when balanced.

    Args:
        logits: ``(B, N)`` router logits.
        index: ``(B,)`` or ``(B, k)`` the chosen members.
    """
    n = logits.shape[1]
    probs = F.softmax(logits, dim=1, dtype=torch.promote_types(logits.dtype, torch.float32))
    f = load(index, n).to(probs.dtype) / max(1, index.numel())
    return n * (f * probs.mean(0)).sum()


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
