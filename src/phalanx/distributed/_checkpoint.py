"""Sharded checkpoints: one safetensors file per rank plus a JSON index of member ranges.

A checkpoint is a directory::

    index.json                      N, the files and the global members each holds, the
                                    optimizer state's structure and its non-tensor values
    members-000000-000004.safetensors   global members 0..3: stack and optimizer tensors
    members-000004-000007.safetensors   global members 4..6

Every per-member tensor is stored under its name with its block of rows, so a loader on any
number of ranks reads, for each of its members, the rows it needs (safetensors reads slices
without loading whole files). torch.distributed.checkpoint is not used: it takes plain
per-rank tensors saved under one name for replicas and keeps one rank's block.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils import _pytree as pytree

from phalanx._stack import Stack
from phalanx.distributed._mesh import Shard, layout
from phalanx.distributed._shard import shard_of

__all__ = ["load", "save"]

FORMAT = "phalanx.distributed.checkpoint"
VERSION = 1
INDEX = "index.json"
_SHARD_FILE = re.compile(r"members-\d{6,}-\d{6,}\.safetensors")
_STACK, _MEMBER, _REPLICA = "stack/", "optim/", "optim-replicated/"


def _file_name(block: range) -> str:
    return f"members-{block.start:06d}-{block.stop:06d}.safetensors"


def _flatten_optimizer(
    state: dict[str, Any], n_local: int, where: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[Any], str]:
    """Splits an optimizer state dict into member tensors, replicated tensors and the rest.

    A tensor with dim 0 of size n_local carries the member axis; a 0-d tensor is the same for
    every member. Anything else cannot be resharded, so it is refused.
    """
    members: dict[str, torch.Tensor] = {}
    replicas: dict[str, torch.Tensor] = {}
    plain: list[Any] = []
    leaves, spec = pytree.tree_flatten_with_path(state)
    for path, leaf in leaves:
        key = pytree.keystr(path)
        if not isinstance(leaf, torch.Tensor):
            if not (leaf is None or isinstance(leaf, bool | int | float | str)):
                raise TypeError(
                    f"{where}: optimizer state entry {key} is a {type(leaf).__name__}; only "
                    f"tensors, numbers, strings, bools and None can be saved."
                )
            plain.append(leaf)
            continue
        plain.append({"tensor": key})
        if leaf.dim() == 0:
            replicas[key] = leaf
        elif leaf.shape[0] == n_local:
            members[key] = leaf
        else:
            raise ValueError(
                f"{where}: optimizer state entry {key} has shape {tuple(leaf.shape)}; expected "
                f"this rank's {n_local} members along dim 0, or a 0-d tensor. Only optimizers "
                f"over this rank's stack.parameters() can be saved per shard."
            )
    return members, replicas, plain, pytree.treespec_dumps(spec)


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Own copies on the CPU: safetensors refuses tensors that share memory (tied weights)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}


def save(
    path: str | os.PathLike[str],
    stack: Stack,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    shard: Shard | None = None,
) -> None:
    """Saves this rank's members (and optimizer state) into a sharded checkpoint directory.

    Call it on every rank at the same point. Each rank writes one safetensors file of its
    members; rank 0 writes ``index.json`` last, once every file is complete. The directory
    must be on a file system every rank sees. The checkpoint loads with
    :func:`phalanx.distributed.load` on any number of ranks, a plain process included.

    Args:
        path: the checkpoint directory; created if missing. Shard files of an earlier save
            that the new index does not list are removed.
        stack: this rank's stack.
        optimizer: an optimizer over ``stack.parameters()`` whose state tensors are
            per-member ``(n_local, ...)`` or 0-d, as phalanx.optim's and torch.optim's are.
        shard: this rank's :class:`Shard`; None for a stack built by
            :func:`phalanx.distributed.shard` or in a plain process.

    Raises:
        ValueError: the stack does not hold the shard's members, or optimizer state that is
            neither per-member nor 0-d.
        DistributedError: another rank failed, or the timeout passed.

    Example:
        >>> phalanx.distributed.save("ckpt", stack, optimizer=opt)
    """
    where = "phalanx.distributed.save()"
    mine = shard if shard is not None else shard_of(stack, where)
    _check_stack(stack, mine, where)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {_STACK + k: v for k, v in stack.state_dict().items()}
    optim_entry = None
    if optimizer is not None:
        members, replicas, plain, spec = _flatten_optimizer(
            optimizer.state_dict(), mine.num_local, where
        )
        tensors.update({_MEMBER + k: v for k, v in members.items()})
        tensors.update({_REPLICA + k: v for k, v in replicas.items()})
        optim_entry = {
            "type": type(optimizer).__qualname__,
            "treespec": spec,
            "leaves": plain,
            "member_keys": sorted(members),
        }
    name = _file_name(mine.global_indices)
    partial = directory / f".{name}.rank{mine.rank}.tmp"
    save_file(_contiguous(tensors), str(partial), metadata={"format": FORMAT})
    os.replace(partial, directory / name)
    mine.barrier()  # every shard file is complete before the index names it
    if mine.rank == 0:
        shards = [{"file": _file_name(r), "start": r.start, "stop": r.stop} for r in mine.ranges]
        index = {
            "format": FORMAT,
            "version": VERSION,
            "num_members": mine.num_members,
            "saved_by_ranks": mine.world_size,
            "shards": shards,
            "stack_keys": sorted(stack.state_dict()),
            "optimizer": optim_entry,
        }
        partial_index = directory / f".{INDEX}.tmp"
        partial_index.write_text(json.dumps(index, indent=1))
        os.replace(partial_index, directory / INDEX)
        listed = {s["file"] for s in shards}
        for stale in directory.iterdir():
            if _SHARD_FILE.fullmatch(stale.name) and stale.name not in listed:
                stale.unlink()
    mine.barrier()  # no rank returns (and perhaps loads) before the index exists


def _check_stack(stack: Stack, shard: Shard, where: str) -> None:
    if len(stack) != shard.num_local:
        raise ValueError(
            f"{where}: the stack holds {len(stack)} members but rank {shard.rank} of "
            f"{shard.world_size} holds {shard.num_local} of {shard.num_members} (global "
            f"{shard.start}..{shard.stop - 1}); build the stack with "
            f"phalanx.distributed.shard(..., num_members={shard.num_members})."
        )


def read_index(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The index of the sharded checkpoint in directory ``path``."""
    where = "phalanx.distributed.load()"
    file = Path(path) / INDEX
    if not file.is_file():
        raise FileNotFoundError(
            f"{where}: {file} does not exist; pass the directory that "
            f"phalanx.distributed.save() wrote (a save that was interrupted has no index), or "
            f"a file that phalanx.save() wrote."
        )
    index = json.loads(file.read_text())
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(
            f"{where}: {file} is not a phalanx.distributed checkpoint index (format "
            f"{index.get('format')!r}, version {index.get('version')!r}); expected {FORMAT!r} "
            f"version {VERSION}."
        )
    return index


class _Sharded:
    """A directory written by :func:`save`: rows of a block read across the shard files."""

    def __init__(self, directory: Path) -> None:
        self.index = read_index(directory)
        self.directory = directory
        self.num_members = int(self.index["num_members"])
        self.stack_keys = set(self.index["stack_keys"])
        self._files: list[tuple[range, Any]] = []
        self._block = range(0)

    def select(self, block: range) -> None:
        for entry in self.index["shards"]:
            stored = range(entry["start"], entry["stop"])
            if max(stored.start, block.start) < min(stored.stop, block.stop):
                handle = safe_open(str(self.directory / entry["file"]), framework="pt")
                self._files.append((stored, handle))
        self._block = block

    def rows(self, key: str) -> torch.Tensor:
        pieces = []
        for stored, handle in self._files:
            lo = max(stored.start, self._block.start) - stored.start
            hi = min(stored.stop, self._block.stop) - stored.start
            pieces.append(handle.get_slice(key)[lo:hi])
        return torch.cat(pieces)

    def stack_rows(self, key: str) -> torch.Tensor:
        return self.rows(_STACK + key)

    def optimizer_state(self) -> dict[str, Any] | None:
        entry = self.index["optimizer"]
        if entry is None:
            return None
        members = set(entry["member_keys"])
        leaves = []
        for leaf in entry["leaves"]:
            if isinstance(leaf, dict):
                key = leaf["tensor"]
                # Replicated tensors are the same in every file: read the first one's.
                leaf = self.rows(_MEMBER + key) if key in members else self._replica(key)
            leaves.append(leaf)
        return pytree.tree_unflatten(leaves, pytree.treespec_loads(entry["treespec"]))

    def _replica(self, key: str) -> torch.Tensor:
        return self._files[0][1].get_tensor(_REPLICA + key)


class _SingleFile:
    """A file written by :func:`phalanx.save` in one process: every member's rows in one file."""

    def __init__(self, file: Path, where: str) -> None:
        self.file = safe_open(str(file), framework="pt")
        raw = (self.file.metadata() or {}).get("phalanx")
        if raw is None:
            raise ValueError(
                f"{where}: {file} is not a phalanx checkpoint (no 'phalanx' metadata); pass a "
                f"directory written by phalanx.distributed.save() or a file by phalanx.save()."
            )
        self.meta = json.loads(raw)
        keys = self.file.keys()  # a safetensors handle is not iterable
        self.stack_keys = {k[len(_STACK) :] for k in keys if k.startswith(_STACK)}
        n = self.meta.get("num_members")
        if n is None and self.stack_keys:
            n = self.file.get_slice(_STACK + min(self.stack_keys)).get_shape()[0]
        self.num_members = int(n or 0)
        self._block = range(0)

    def select(self, block: range) -> None:
        self._block = block

    def stack_rows(self, key: str) -> torch.Tensor:
        return self.file.get_slice(_STACK + key)[self._block.start : self._block.stop]

    def __getitem__(self, key: str) -> torch.Tensor:
        """A tensor of the optimizer state: this block's rows when it carries the members."""
        shape = self.file.get_slice(key).get_shape()
        if shape and shape[0] == self.num_members:
            return self.file.get_slice(key)[self._block.start : self._block.stop]
        return self.file.get_tensor(key)

    def optimizer_state(self) -> dict[str, Any] | None:
        from phalanx._checkpoint import _decode

        if "optimizer" not in self.meta:
            return None
        return _decode(self.meta["optimizer"], self)  # type: ignore[arg-type]


def load(
    path: str | os.PathLike[str],
    stack: Stack,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    shard: Shard | None = None,
) -> None:
    """Loads this rank's members (and optimizer state) from a checkpoint of all N members.

    The checkpoint may have been written by any number of ranks (a directory from
    :func:`phalanx.distributed.save`) or by one process (a file from :func:`phalanx.save`):
    each rank reads only the rows of its own global members. In a plain process, a stack of
    all N members loads everything, e.g. to write it again with :func:`phalanx.save`.

    Args:
        path: a directory written by :func:`phalanx.distributed.save`, or a file written by
            :func:`phalanx.save`.
        stack: this rank's stack, built with the checkpoint's N (e.g. by
            ``phalanx.distributed.shard(factory, num_members=N)``); its tensors are
            overwritten in place.
        optimizer: an optimizer over ``stack.parameters()`` to restore; the checkpoint must
            hold optimizer state then.
        shard: this rank's :class:`Shard`; None for a stack built by
            :func:`phalanx.distributed.shard` or in a plain process.

    Raises:
        FileNotFoundError: ``path`` is neither a checkpoint file nor a directory with an
            index.
        ValueError: the checkpoint has another N, other parameter names or shapes, or no
            optimizer state when one is asked for. Nothing is changed then.

    Example:
        >>> stack, shard = phalanx.distributed.shard(make_member, num_members=8)
        >>> phalanx.distributed.load("ckpt", stack, optimizer=opt)
    """
    from phalanx.distributed._shard import _shards

    where = "phalanx.distributed.load()"
    location = Path(path)
    source: _Sharded | _SingleFile = (
        _SingleFile(location, where) if location.is_file() else _Sharded(location)
    )
    n = source.num_members
    if shard is None:
        known = _shards.get(stack)
        shard = known if known is not None else layout(n)
    if shard.num_members != n:
        raise ValueError(
            f"{where}: the checkpoint {location} holds {n} members but this run has "
            f"{shard.num_members}; build the stack with num_members={n}."
        )
    _check_stack(stack, shard, where)
    own = stack.state_dict()
    missing, unexpected = sorted(set(own) - source.stack_keys), sorted(source.stack_keys - set(own))
    if missing or unexpected:
        raise ValueError(
            f"{where}: the checkpoint's members have other parameters and buffers than the "
            f"stack's: missing from the checkpoint {missing}, not in the stack {unexpected}. "
            f"Build the members with the architecture that was saved."
        )
    source.select(shard.global_indices)
    state = {key: source.stack_rows(key) for key in own}
    wrong = [
        f"{key!r}: checkpoint {tuple(state[key].shape)}, stack {tuple(value.shape)}"
        for key, value in own.items()
        if state[key].shape != value.shape
    ]
    if wrong:
        raise ValueError(
            f"{where}: shapes differ between the checkpoint and the stack (this rank's "
            f"{shard.num_local} members):\n  - " + "\n  - ".join(wrong)
        )
    if optimizer is not None:
        optimizer_state = source.optimizer_state()
        if optimizer_state is None:
            raise ValueError(
                f"{where}: the checkpoint {location} holds no optimizer state; load without "
                f"optimizer=, or save with optimizer=opt."
            )
        optimizer.load_state_dict(optimizer_state)
    stack.load_state_dict(state)
