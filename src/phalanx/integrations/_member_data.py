"""A per-member data order for the Trainer: each member its own shuffle or bootstrap resample
of the training set, in the orders ``phalanx.data.MemberLoader`` walks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from phalanx.data import MemberLoader

MEMBER_DATA = ("shared", "shuffle", "bootstrap")


class MemberBatches(torch.utils.data.Sampler[list[int]]):
    """A batch sampler yielding N * B dataset indices, member-major: member i's B samples are
    ``batch[i * B : (i + 1) * B]``, in member i's order of ``MemberLoader(..., seed=seed)``.

    ``set_epoch(e)`` (called by the Trainer through accelerate each epoch) walks epoch e's
    orders; the bootstrap resample is drawn once, for all epochs.
    """

    def __init__(
        self, size: int, num_members: int, batch_size: int, *, bootstrap: bool, seed: int
    ) -> None:
        self.loader = MemberLoader(
            torch.arange(size),
            num_members=num_members,
            batch_size=batch_size,
            bootstrap=bootstrap,
            seed=seed,
        )

    def set_epoch(self, epoch: int) -> None:
        self.loader.epoch, self.loader.batch = epoch, 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.loader.epoch
        for (index,) in self.loader:  # (N, B)
            yield index.flatten().tolist()
        self.set_epoch(epoch)  # the Trainer sets the next epoch; an unset one repeats


class MemberCollate:
    """The Trainer's collator on all N * B samples at once (one padding for every member),
    each tensor then viewed as ``(N, B, ...)``."""

    def __init__(self, collate: Callable[[list[Any]], Any], num_members: int) -> None:
        self.collate = collate
        self.num_members = num_members

    def __call__(self, features: list[Any]) -> Any:
        batch = self.collate(features)
        n = self.num_members

        def per_member(t: Any) -> Any:
            return t.view(n, t.shape[0] // n, *t.shape[1:]) if isinstance(t, Tensor) else t

        if isinstance(batch, dict) or hasattr(batch, "items"):
            return type(batch)({k: per_member(v) for k, v in batch.items()})
        return type(batch)(per_member(t) for t in batch)
