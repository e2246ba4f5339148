"""The checks of a routed call's arguments (``members=``, ``weights=``, ``subset=``), each
error naming the fix, and the checked routing: the sort of the flat entries into member
segments."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch

from phalanx import _torch_compat as compat
from phalanx.routing import Dispatch

WHERE = "Stack.forward()"


class Routing:
    """A checked routing: per flat entry its member, its row, and the sort into segments.

    Attributes:
        index: ``(B,)`` or ``(B, k)`` long tensor of members.
        weights: ``None`` or a tensor of the index's shape.
        keep: ``None`` or a bool tensor of the index's shape; False entries are dropped
            (their contribution is zero), e.g. rows over a member's capacity.
    """

    def __init__(
        self,
        index: torch.Tensor,
        weights: torch.Tensor | None,
        keep: torch.Tensor | None,
        num_members: int,
    ) -> None:
        self.index, self.weights, self.keep = index, weights, keep
        self.derived: dict[str, Any] = {}  # what the paths derive from the sort, kept with it
        self.rows = index.shape[0]
        self.k = 1 if index.dim() == 1 else index.shape[1]
        flat = index.reshape(-1)
        if keep is not None:
            kept = keep.reshape(-1)
            position = torch.arange(flat.numel(), device=flat.device)[kept]
            flat = flat[kept]
        # each sorted entry's member, and the sort's order, in one call
        self.member_of, order = torch.sort(flat, stable=True)
        # flat positions in segment order (``position`` is ``0..B*k-1`` unless entries drop)
        self.entries = order if keep is None else position.index_select(0, order)
        self.source_rows = self.entries // self.k if self.k > 1 else self.entries
        # Everything the host needs in one read, the call's one host sync: where each
        # member's entries start and end in the sorted entries (``searchsorted`` on the
        # sorted members: the counts, and the index's range, checked here before any use:
        # entries below 0 sort before member 0's first, entries of N or more after member
        # N-1's last), and whether the rows are in order (a stable sort of a sorted index
        # keeps every row in place). No kernel reads memory at an entry's value before the
        # check raises; bincount would sync on its own.
        total = int(flat.numel())
        bounds = torch.searchsorted(
            self.member_of, torch.arange(num_members + 1, device=flat.device)
        )
        ordered = index.dim() == 1 and keep is None
        moved = (self.member_of != index).sum().view(1) if ordered else bounds[:1]
        read: list[int] = torch.cat([moved, bounds]).tolist()
        if read[1] != 0 or read[-1] != total:
            bad = int(flat.min()) if read[1] != 0 else int(flat.max())
            last = num_members - 1
            raise IndexError(
                f"{WHERE}: members= holds member index {bad}, but the stack has {num_members} "
                f"members (indices 0 to {last}); every entry must be a member index."
            )
        self.count_list: list[int] = [b - a for a, b in itertools.pairwise(read[1:])]
        self.total = total
        self._in_order = ordered and read[0] == 0

    def with_weights(self, weights: torch.Tensor | None) -> Routing:
        """This routing with this call's ``weights`` (the sort depends on the index alone)."""
        if weights is self.weights:
            return self
        routing = copy.copy(self)
        routing.weights = weights
        return routing

    @property
    def in_order(self) -> bool:
        """One member per row, none dropped, and the rows already in member order: the
        sorted rows are the input's own (``entries`` is ``0..B-1``), so no gather and no
        scatter is needed."""
        return self._in_order

    def gather(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The positional tensor inputs' rows in segment order (a copy: a member may write
        its input in place, as it may in the loop, where it gets ``x[index == i]``)."""
        return tuple(
            a.index_select(0, self.source_rows) if isinstance(a, torch.Tensor) else a for a in args
        )


def routing_from(
    members: Any,
    weights: Any,
    rows: int | None,
    num_members: int,
    device: torch.device | None,
    cache: dict[str, Any] | None = None,
) -> Routing:
    """Checks ``members=``/``weights=`` against the inputs and the stack, naming the fix.

    With ``cache`` (the stack's routed cache), the sort of an index tensor is kept for the
    next call with the same index (``_kept_routing``)."""
    keep = None

    if isinstance(members, Dispatch):
        if weights is not None:
            raise ValueError(
                f"{WHERE}: members= is a phalanx.routing.Dispatch, which carries its own "
                f"weights; drop weights=."
            )
        members, weights, keep = members.index, members.weights, members.keep
    if not isinstance(members, torch.Tensor):
        raise TypeError(
            f"{WHERE}: members= routes input rows to members and takes an integer tensor, "
            f"(B,) or (B, k), one entry per input row; got a {type(members).__name__}. To run "
            f"only some members on the whole input, pass subset=[i, j, ...] instead; for a "
            f"routing held in a list, pass torch.tensor(index)."
        )
    if members.is_floating_point() or members.is_complex() or members.dtype == torch.bool:
        raise TypeError(
            f"{WHERE}: members= must hold integer member indices; got dtype {members.dtype}. "
            f"Convert it with index.long()."
        )
    if members.dim() not in (1, 2):
        raise ValueError(
            f"{WHERE}: members= must be (B,) (one member per row) or (B, k) (k members per "
            f"row); got shape {tuple(members.shape)}. Flatten the leading dims of the inputs "
            f"and the index first, e.g. x.flatten(0, 1) with index.flatten(0, 1)."
        )
    if rows is not None and members.shape[0] != rows:
        raise ValueError(
            f"{WHERE}: members= has {members.shape[0]} rows but the inputs have {rows}; give "
            f"one entry (or one row of k entries) per input row."
        )
    if device is not None and members.device != device:
        raise ValueError(
            f"{WHERE}: members= is on {members.device}, the inputs on {device}; move it with "
            f"index.to({str(device)!r})."
        )
    given = members
    members = members.long()  # its range is checked by Routing, in the call's one host read
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
            raise TypeError(
                f"{WHERE}: weights= must be a floating-point tensor of the index's shape "
                f"{tuple(members.shape)}; got "
                + (
                    f"dtype {weights.dtype}"
                    if isinstance(weights, torch.Tensor)
                    else type(weights).__name__
                )
                + "."
            )
        if weights.shape != members.shape:
            raise ValueError(
                f"{WHERE}: weights= must have the index's shape {tuple(members.shape)} (one "
                f"weight per routed entry); got {tuple(weights.shape)}."
            )
        if weights.device != members.device:
            raise ValueError(
                f"{WHERE}: weights= is on {weights.device}, members= on {members.device}; "
                f"put them on one device."
            )
    if cache is None or keep is not None:
        return Routing(members, weights, keep, num_members)
    return _kept_routing(cache, given, members, weights, num_members)


def _kept_routing(
    cache: dict[str, Any],
    given: torch.Tensor,
    members: torch.Tensor,
    weights: torch.Tensor | None,
    num_members: int,
) -> Routing:
    """The routing of the index ``given`` (``members`` its long form), sorted once and kept
    while the next call passes the same tensor object unchanged: same version counter (any
    in-place write bumps it), same memory, shape and dtype, same stack size, the same
    inference mode. The sort, the counts, the range check and the call's one host read are
    then skipped (a PETS or TS-infinity rollout, a KiloNeRF grid: one index for many calls).
    The kept tensor is held, so its identity cannot pass to a new tensor. Inference tensors
    (no version counter) are sorted on every call."""
    if given.is_inference():
        return Routing(members, weights, None, num_members)
    key = (
        compat.version(given),
        compat.memory_stamp(given),
        num_members,
        torch.is_inference_mode_enabled(),
    )
    kept = cache.get("routing")
    if kept is not None and kept[0] is given and kept[1] == key:
        routing: Routing = kept[2]
        return routing.with_weights(weights)
    routing = Routing(members, None, None, num_members)  # no call's weights (nor their graph)
    cache["routing"] = (given, key, routing)
    return routing.with_weights(weights)


def routed_inputs(args: tuple[Any, ...]) -> tuple[int | None, torch.device | None]:
    """The rows and device of the routed positional inputs (every tensor among them)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        raise ValueError(
            f"{WHERE}: members= routes the rows of the positional inputs, but none is a "
            f"tensor; pass the input rows positionally, stack(x, members=index)."
        )
    rows = {a.shape[0] if a.dim() else None for a in tensors}
    if None in rows or len(rows) > 1:
        shapes = ", ".join(str(tuple(a.shape)) for a in tensors)
        raise ValueError(
            f"{WHERE}: with members= every positional tensor input is split by rows along "
            f"dim 0, so all must have the same first dimension; got {shapes}. Pass an input "
            f"every member sees whole as a keyword argument."
        )
    return rows.pop(), tensors[0].device


# ------------------------------------------------------------------------------ entry point


def subset_index(subset: Any, num_members: int) -> list[int]:
    """``subset=`` as a list of distinct member indices, checked, naming the fix."""
    where = f"{WHERE}: subset="
    if isinstance(subset, torch.Tensor):
        if subset.dim() != 1 or subset.is_floating_point() or subset.dtype == torch.bool:
            raise TypeError(
                f"{where} takes distinct member indices: a list of ints or a 1-D integer "
                f"tensor; got a tensor of dtype {subset.dtype} and shape {tuple(subset.shape)}. "
                f"To send each input row to its own member, use members=index."
            )
        chosen = subset.tolist()
    elif isinstance(subset, (list, tuple, range)):
        chosen = list(subset)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in chosen):
            raise TypeError(f"{where} takes distinct member indices (ints); got {subset!r}.")
    else:
        raise TypeError(
            f"{where} takes distinct member indices: a list of ints or a 1-D integer tensor; "
            f"got a {type(subset).__name__}."
        )
    if not chosen:
        raise ValueError(f"{where} is empty; name at least one member.")
    bad = [i for i in chosen if not 0 <= i < num_members]
    if bad:
        raise IndexError(
            f"{where} holds member index {bad[0]}, but the stack has {num_members} members "
            f"(indices 0 to {num_members - 1})."
        )
    if len(set(chosen)) != len(chosen):
        raise ValueError(
            f"{where} holds a member twice ({chosen}); give distinct members (to run a member "
            f"on several inputs, use members= routing)."
        )
    return chosen
