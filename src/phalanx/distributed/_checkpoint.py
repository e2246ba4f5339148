"""Sharded checkpoints of a whole run: one safetensors file per rank plus a JSON index.

A checkpoint is a directory::

    index.json                          the committed generation: N, each file with the
                                        global members it holds, its size and SHA-256, and
                                        each part's type and non-tensor state
    gen-000007/members-000000-000004.safetensors   global members 0..3 of generation 7
    gen-000007/members-000004-000007.safetensors   global members 4..6

It holds what a run needs to continue exactly: the stack, the optimizer, the scheduler, the
loader's position and any extras (the step, the epoch, metrics), as ``phalanx.save`` does
in one file. A save is a transaction (:mod:`._transaction`): the ranks agree on what they
hold and that they share the directory before anything is written; rank 0 commits by
replacing ``index.json`` in one atomic rename once every file is complete; only then is the
previous generation removed. A save killed at any instant, on any rank, leaves ``index.json``
naming a generation whose files are all complete: the previous one or the new one. A load
checks the size and SHA-256 of every file it reads against the index, and every part
against the objects it is loaded into, and refuses on every rank if anything differs.

Every per-member tensor is stored with its block of rows, so a load on any number of ranks
reads, for each of its members, the rows it needs (safetensors reads slices without loading
whole files).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint._files import atomic_write_text, save_atomic
from phalanx.checkpoint._fit import CheckpointError, check_part
from phalanx.core._stack import Stack
from phalanx.distributed import _health
from phalanx.distributed._agree import describe_members, exchange
from phalanx.distributed._mesh import Shard, layout
from phalanx.distributed._parts import PARTS, encode_part, localize_loader
from phalanx.distributed._shard import _shards, shard_of
from phalanx.distributed._sources import (
    FORMAT,
    INDEX,
    STACK,
    SUPERSEDED,
    VERSION,
    Sharded,
    SingleFile,
)
from phalanx.distributed._transaction import (
    file_name,
    generation_name,
    is_root,
    missing_files,
    outcome,
    preflight,
    remove_superseded,
)

__all__ = ["load", "save"]

# Indirections the tests replace (to play every rank of a save in one process, or to kill
# a save at each step: tests/test_crash.py).
_preflight = preflight
_outcome = outcome
_remove_superseded = remove_superseded


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Own copies on the CPU: safetensors refuses tensors that share memory (tied weights)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of every tensor this rank would write, to compare data replicas."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key]
        h.update(f"{key} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _all_entries(entry: dict[str, Any] | None, shard: Shard, where: str) -> list[Any]:
    """Every rank's shard entry, by rank; waits until every rank has written its file."""
    return exchange(entry, shard, where, "the written files")


def save(
    path: str | os.PathLike[str],
    stack: Stack,
    optimizer: Any = None,
    scheduler: Any = None,
    loader: Any = None,
    *,
    shard: Shard | None = None,
    **extra: Any,
) -> None:
    """Saves this rank's share of a training run into a sharded checkpoint directory.

    The same call as :func:`phalanx.save`, on every rank at the same point: the stack, and
    optionally the optimizer, the LR scheduler, the loader's position and extras (the step,
    the epoch, a best score), so that :func:`phalanx.distributed.load` continues the run
    exactly, on any number of ranks.

    The save is a transaction. First the ranks compare what they hold (N, the members'
    shapes and dtypes, each part's type, structure and everything in it that is not
    per-member) and check that they all see one directory (rank 0 writes a marker file that
    every rank must read back); on any difference every rank raises and nothing is written.
    Then each rank writes its members' rows into a new generation beside the committed one;
    once every rank has finished, rank 0 checks that it sees every file and commits by
    atomically replacing ``index.json``, and only then removes the previous generation. If
    any rank is killed at any instant, the directory still loads as the previous checkpoint
    (or, once committed, the new one).

    Args:
        path: the checkpoint directory; created if missing. It must be on a file system
            every rank sees (the save refuses otherwise).
        stack: this rank's stack.
        optimizer: an optimizer over ``stack.parameters()``, phalanx's or torch's.
        scheduler: an LR scheduler (torch's, or ``phalanx.optim.MemberLambdaLR``).
        loader: this rank's ``phalanx.data.MemberLoader`` (from ``shard.loader``): its
            position is saved for all N members, so it resumes on any world size.
        shard: this rank's :class:`Shard`; None for a stack built by
            :func:`phalanx.distributed.shard` or in a plain process.
        **extra: more state: tensors, numbers, strings, lists and dicts of them, e.g.
            ``step=1200``. They must be the same on every rank, except tensors whose dim 0
            is this rank's number of members, which are saved per member.

    Raises:
        ValueError: the stack does not hold the shard's members.
        TypeError: some state is neither a tensor nor JSON data.
        CheckpointError: (a ValueError, on every rank) the ranks disagree on what they hold,
            or do not all see the directory ``path``; nothing was written, and the previous
            checkpoint is as it was.
        DistributedError: another rank failed, or the timeout passed; nothing was committed.

    Example:
        >>> X, Y = torch.randn(64, 4), torch.randn(64, 1)
        >>> stack, shard = phalanx.distributed.shard(lambda i: nn.Linear(4, 1), num_members=8)
        >>> opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
        >>> loader = shard.loader(X, Y, batch_size=16, seed=0)
        >>> phalanx.distributed.save("ckpt", stack, optimizer=opt, loader=loader, step=1200)
    """
    where = "phalanx.distributed.save()"
    mine = shard if shard is not None else shard_of(stack, where)
    _check_stack(stack, mine, where)
    directory = Path(path)
    tensors = {STACK + k: v for k, v in stack.state_dict().items()}
    objects = {"optimizer": optimizer, "scheduler": scheduler, "loader": loader, "extra": extra}
    parts = {
        name: encode_part(name, obj, mine.num_local, mine.num_members)
        for name, obj in objects.items()
        if obj is not None and (name != "extra" or obj)
    }
    facts: dict[str, Any] = {
        "num_members": mine.num_members,
        "world_size": mine.world_size,
        "the members' parameters and buffers (shape, dtype)": describe_members(stack),
        "parts saved": sorted(parts),
    }
    for part in parts.values():
        tensors.update(part.files())
        facts.update(part.facts())
    facts["replicas"] = mine.num_replicas
    local = _contiguous(tensors)
    rows = _digest(local) if mine.num_replicas > 1 else None
    generation = _preflight(directory, mine, facts, where, rows)
    entry = None
    if mine.is_writer:  # one file per member block: its replica 0 writes it
        name = f"{generation_name(generation)}/{file_name(mine.global_indices)}"
        size, digest = save_atomic(local, directory / name, {"format": FORMAT})
        entry = {
            "file": name,
            "start": mine.start,
            "stop": mine.stop,
            "size": size,
            "sha256": digest,
        }
    # Waits until every file is complete, before the index names it.
    shards = [e for e in _all_entries(entry, mine, where) if e is not None]
    problem = None
    if is_root(mine):
        problem = missing_files(directory, shards)
        if problem is None:
            index = {
                "format": FORMAT,
                "version": VERSION,
                "generation": generation,
                "num_members": mine.num_members,
                "saved_by_ranks": mine.world_size,
                "shards": shards,
                "stack_keys": sorted(stack.state_dict()),
                "parts": {name: part.entry for name, part in parts.items()},
            }
            atomic_write_text(directory / INDEX, json.dumps(index, indent=1))  # the commit
            _remove_superseded(directory, generation, {s["file"] for s in shards})
    # No rank returns (and perhaps loads) before the index exists, and all learn the outcome.
    problem = _outcome(problem, mine, where)
    if problem is not None:
        raise CheckpointError(
            f"{where}: nothing was committed; the previous checkpoint in {directory} is as it "
            f"was: {problem}"
        )
    _health.note_checkpoint(f"{directory} generation {generation}")


_LOAD_ATTEMPTS = 5
"""How often a load reads the newest generation again when saves keep replacing it."""


def _check_stack(stack: Stack, shard: Shard, where: str) -> None:
    if len(stack) != shard.num_local:
        raise ValueError(
            f"{where}: the stack holds {len(stack)} members but rank {shard.rank} of "
            f"{shard.world_size} holds {shard.num_local} of {shard.num_members} (global "
            f"{shard.start}..{shard.stop - 1}); build the stack with "
            f"phalanx.distributed.shard(..., num_members={shard.num_members})."
        )


def _agree(problem: str | None, shard: Shard, where: str) -> str | None:
    """The first rank's problem on every rank, so that all refuse together or none does."""
    table = exchange(problem, shard, where, "the checkpoint checks")
    if len(table) == 1:
        return problem
    return next((f"(found by rank {r}) {p}" for r, p in enumerate(table) if p is not None), None)


def load(
    path: str | os.PathLike[str],
    stack: Stack,
    optimizer: Any = None,
    scheduler: Any = None,
    loader: Any = None,
    *,
    shard: Shard | None = None,
) -> dict[str, Any]:
    """Restores this rank's share of a run from a checkpoint of all N members.

    The same call as :func:`phalanx.load`, on every rank at the same point. The checkpoint
    may have been written by any number of ranks (a directory from
    :func:`phalanx.distributed.save`) or by one process (a file from :func:`phalanx.save`):
    each rank reads only the rows of its own global members, and its loader continues where
    each of its members' streams stopped. Every file read is checked against the size and
    SHA-256 the index committed, and every part against the object it is loaded into, before
    anything is written; the ranks agree, so on any error every rank raises and nothing is
    changed on any rank.

    Args:
        path: a directory written by :func:`phalanx.distributed.save`, or a file written by
            :func:`phalanx.save`.
        stack: this rank's stack, built with the checkpoint's N (e.g. by
            ``phalanx.distributed.shard(factory, num_members=N)``); its tensors are
            overwritten in place.
        optimizer, scheduler, loader: objects to restore, built like the saved ones (the
            same types; the loader from ``shard.loader``); each must have been saved.
        shard: this rank's :class:`Shard`; None for a stack built by
            :func:`phalanx.distributed.shard` or in a plain process.

    Returns:
        The extras given to ``save``; per-member tensors hold this rank's members' rows.

    Raises:
        FileNotFoundError: ``path`` is neither a checkpoint file nor a directory with an
            index.
        CheckpointError: (a ValueError) a file is missing, truncated, corrupt or not a phalanx
            checkpoint; or the checkpoint has another N, other parameter names, shapes or
            dtypes, lacks a requested part, or holds one of another type or structure.

    Example:
        >>> X, Y = torch.randn(64, 4), torch.randn(64, 1)
        >>> stack, shard = phalanx.distributed.shard(lambda i: nn.Linear(4, 1), num_members=8)
        >>> opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
        >>> loader = shard.loader(X, Y, batch_size=16, seed=0)
        >>> phalanx.distributed.save("ckpt", stack, optimizer=opt, loader=loader, step=1200)
        >>> extra = phalanx.distributed.load("ckpt", stack, optimizer=opt, loader=loader)
        >>> extra["step"]
        1200
    """
    where = "phalanx.distributed.load()"
    location = Path(path)
    for _ in range(_LOAD_ATTEMPTS):
        source: Sharded | SingleFile = (
            SingleFile(location, where) if location.is_file() else Sharded(location)
        )
        n = source.num_members
        if shard is None:
            known = _shards.get(stack)
            shard = known if known is not None else layout(n)
        if shard.num_members != n:
            raise CheckpointError(
                f"{where}: the checkpoint {location} holds {n} members but this run has "
                f"{shard.num_members}; build the stack with num_members={n}."
            )
        _check_stack(stack, shard, where)
        own = stack.state_dict()
        missing = sorted(set(own) - source.stack_keys)
        unexpected = sorted(source.stack_keys - set(own))
        if missing or unexpected:
            raise CheckpointError(
                f"{where}: the checkpoint's members have other parameters and buffers than the "
                f"stack's: missing from the checkpoint {missing}, not in the stack "
                f"{unexpected}. Build the members with the architecture that was saved."
            )
        problem = source.select(shard.global_indices)
        generations = {row for row in exchange(source.generation, shard, where, "the generation")}
        if problem is None and len(generations) > 1:  # a save committed between two reads
            problem = f"the ranks read generations {sorted(generations)}: one {SUPERSEDED}"
        problem = _agree(problem, shard, where)
        if problem is None or SUPERSEDED not in problem:
            break
        # A save committed a new generation (and removed this one) while this load read it:
        # every rank learnt it from the same exchange and reads the new one.
    else:
        raise CheckpointError(
            f"{where}: the checkpoint {location} was replaced by a newer save each of the "
            f"{_LOAD_ATTEMPTS} times this load read it ({problem}); load while saves pause."
        )
    if problem is not None:
        raise CheckpointError(
            f"{where}: the checkpoint {location} is damaged: {problem}. A killed save never "
            f"does this (it leaves the previous generation whole); the files were changed or "
            f"lost after the save. Restore the directory from a copy."
        )
    objects = {"optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    try:
        state, states, extra = _read_checked(source, own, objects, shard, where, str(location))
        refusal = None
    except CheckpointError as e:
        refusal = str(e)
    # Every rank checked its own rows: all load, or all refuse with the first rank's reason.
    refusal = _agree(refusal, shard, where)
    if refusal is not None:
        raise CheckpointError(refusal)
    # Every check passed on every rank: only now is anything written.
    stack.load_state_dict(state)
    for name, part_state in states.items():
        objects[name].load_state_dict(part_state)
    return extra


def _read_checked(
    source: Sharded | SingleFile,
    own: dict[str, torch.Tensor],
    objects: dict[str, Any],
    shard: Shard,
    where: str,
    location: str,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """This rank's stack rows, parts and extras, each checked against what it loads into."""
    try:
        state = {key: source.stack_rows(key) for key in own}
        read = {name: source.part(name) for name in PARTS if objects.get(name) is not None}
        extra = source.part("extra") or {}
    except CheckpointError:
        raise
    except Exception as e:  # a committed file or index whose contents disagree
        raise CheckpointError(
            f"{where}: the checkpoint {location} is corrupt: reading it failed with "
            f"{type(e).__name__}: {e}."
        ) from None
    wrong = [
        f"{key!r}: checkpoint {tuple(state[key].shape)} {state[key].dtype}, stack "
        f"{tuple(value.shape)} {value.dtype}"
        for key, value in own.items()
        if state[key].shape != value.shape or state[key].dtype != value.dtype
    ]
    if wrong:
        raise CheckpointError(
            f"{where}: shapes or dtypes differ between the checkpoint and the stack (this "
            f"rank's {shard.num_local} members):\n  - " + "\n  - ".join(wrong)
        )
    states = {}
    for name, saved in read.items():
        obj = objects[name]
        if saved is None:
            raise CheckpointError(
                f"{where}: the checkpoint {location} holds no {name} state; load without "
                f"{name}=, or save with {name}={name}."
            )

        def local(state: dict) -> dict:
            return localize_loader(state, shard.start, shard.stop, shard.num_members)

        states[name] = check_part(
            where, str(location), name, obj, saved, source.part_type(name),
            adapt=local if name == "loader" else None,
        )  # fmt: skip
    if not isinstance(extra, dict):
        raise CheckpointError(f"{where}: '{location}' is corrupt: its extras are not a mapping.")
    return state, states, extra
