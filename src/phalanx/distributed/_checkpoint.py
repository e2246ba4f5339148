"""Sharded checkpoints: one safetensors file per rank plus a JSON index, saved as a transaction.

A checkpoint is a directory::

    index.json                          the committed generation: N, each file with the
                                        global members it holds, its size and SHA-256, the
                                        optimizer's type, structure and non-tensor values
    gen-000007/members-000000-000004.safetensors   global members 0..3 of generation 7
    gen-000007/members-000004-000007.safetensors   global members 4..6

A save writes generation g+1 beside generation g (each file atomically), gathers every
rank's file sizes and checksums (which waits until every rank has finished), and then rank 0
commits by replacing ``index.json`` in one atomic rename; only after that is generation g
removed. A save killed at any instant, on any rank, leaves ``index.json`` naming a
generation whose files are all complete: the previous one or the new one. A load checks the
size and SHA-256 of every file it reads against the index and refuses on every rank if one
differs.

Every per-member tensor is stored under its name with its block of rows, so a loader on any
number of ranks reads, for each of its members, the rows it needs (safetensors reads slices
without loading whole files). torch.distributed.checkpoint is not used: it takes plain
per-rank tensors saved under one name for replicas and keeps one rank's block.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from phalanx._checks import CheckpointError, check_optimizer, type_name
from phalanx._files import atomic_write_text, fsync_directory, save_atomic
from phalanx._stack import Stack
from phalanx.distributed import _health
from phalanx.distributed._agree import describe_members, differences, exchange
from phalanx.distributed._mesh import Shard, collective, layout
from phalanx.distributed._shard import shard_of
from phalanx.distributed._sources import (
    FORMAT,
    GENERATION,
    INDEX,
    MEMBER,
    OLD_SHARD_FILE,
    REPLICA,
    STACK,
    VERSION,
    Sharded,
    SingleFile,
)

__all__ = ["load", "save"]


def _file_name(block: range) -> str:
    return f"members-{block.start:06d}-{block.stop:06d}.safetensors"


def _generation_name(generation: int) -> str:
    return f"gen-{generation:06d}"


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


def _next_generation(directory: Path) -> int:
    """One past every generation present, committed or left by a killed save: a new save
    never writes into a generation that an index may name."""
    numbers = [0]
    for entry in directory.iterdir():
        match = GENERATION.fullmatch(entry.name)
        if match:
            numbers.append(int(match.group(1)))
    try:
        committed = json.loads((directory / INDEX).read_text()).get("generation", 0)
        numbers.append(int(committed))
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        pass
    return max(numbers) + 1


def _all_entries(entry: dict[str, Any], shard: Shard, where: str) -> list[dict[str, Any]]:
    """Every rank's shard entry, by rank; waits until every rank has written its file."""
    return exchange(entry, shard, where, "the written files")


def save(
    path: str | os.PathLike[str],
    stack: Stack,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    shard: Shard | None = None,
) -> None:
    """Saves this rank's members (and optimizer state) into a sharded checkpoint directory.

    Call it on every rank at the same point. The save is a transaction: first the ranks
    compare what they hold (N, the members' shapes and dtypes, the optimizer's type and
    structure) and check that they all see one directory (rank 0 writes a marker file that
    every rank must read back); on any difference every rank raises and nothing is written.
    Then each rank writes its members into a new generation beside the committed one; once
    every rank has finished, rank 0 checks that every rank's file is there and commits by
    atomically replacing ``index.json`` (which names every file with its size and SHA-256),
    and only then removes the previous generation. If any rank is killed at any instant,
    the directory still loads as the previous checkpoint (or, once committed, the new one).
    The checkpoint loads with :func:`phalanx.distributed.load` on any number of ranks, a
    plain process included.

    Args:
        path: the checkpoint directory; created if missing. It must be on a file system
            every rank sees (the save refuses otherwise).
        stack: this rank's stack.
        optimizer: an optimizer over ``stack.parameters()`` whose state tensors are
            per-member ``(n_local, ...)`` or 0-d, as phalanx.optim's and torch.optim's are.
        shard: this rank's :class:`Shard`; None for a stack built by
            :func:`phalanx.distributed.shard` or in a plain process.

    Raises:
        ValueError: the stack does not hold the shard's members, or optimizer state that is
            neither per-member nor 0-d.
        CheckpointError: (a ValueError, on every rank) the ranks disagree on what they hold,
            or do not all see the directory ``path``; nothing was written, and the previous
            checkpoint is as it was.
        DistributedError: another rank failed, or the timeout passed; nothing was committed.

    Example:
        >>> phalanx.distributed.save("ckpt", stack, optimizer=opt)
    """
    where = "phalanx.distributed.save()"
    mine = shard if shard is not None else shard_of(stack, where)
    _check_stack(stack, mine, where)
    directory = Path(path)
    tensors = {STACK + k: v for k, v in stack.state_dict().items()}
    optim_entry = None
    if optimizer is not None:
        members, replicas, plain, spec = _flatten_optimizer(
            optimizer.state_dict(), mine.num_local, where
        )
        tensors.update({MEMBER + k: v for k, v in members.items()})
        tensors.update({REPLICA + k: v for k, v in replicas.items()})
        optim_entry = {
            "type": type_name(optimizer),
            "treespec": spec,
            "leaves": plain,
            "member_keys": sorted(members),
        }
    facts = {
        "num_members": mine.num_members,
        "world_size": mine.world_size,
        "the members' parameters and buffers (shape, dtype)": describe_members(stack),
        "optimizer": None if optim_entry is None else optim_entry["type"],
        "optimizer state structure": None if optim_entry is None else optim_entry["treespec"],
    }
    generation = _preflight(directory, mine, facts, where)
    name = f"{_generation_name(generation)}/{_file_name(mine.global_indices)}"
    size, digest = save_atomic(_contiguous(tensors), directory / name, {"format": FORMAT})
    entry = {"file": name, "start": mine.start, "stop": mine.stop, "size": size, "sha256": digest}
    shards = _all_entries(entry, mine, where)  # every file is complete before the index names it
    problem = None
    if mine.rank == 0:
        problem = _missing_files(directory, shards)
        if problem is None:
            index = {
                "format": FORMAT,
                "version": VERSION,
                "generation": generation,
                "num_members": mine.num_members,
                "saved_by_ranks": mine.world_size,
                "shards": shards,
                "stack_keys": sorted(stack.state_dict()),
                "optimizer": optim_entry,
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


def _preflight(directory: Path, shard: Shard, facts: dict[str, Any], where: str) -> int:
    """The generation to write, once every rank holds the same kind of state and sees the
    same directory; otherwise a CheckpointError on every rank, before anything is written.

    Two exchanges: the facts (with rank 0's marker file and generation), then whether each
    rank read the marker. Every rank judges the same table, so all refuse together.
    """
    marker = None
    if shard.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        facts = {**facts, "generation": _next_generation(directory)}
        if shard.world_size > 1:
            marker = _write_marker(directory)
    here = {"host": socket.gethostname(), "directory": os.path.abspath(directory)}
    table = exchange({"facts": facts, "marker": marker, **here}, shard, where, "the save's plan")
    try:
        generation = int(table[0]["facts"].pop("generation"))
        problems = differences([row["facts"] for row in table])
        problems += _layout_problems(shard, [row["facts"]["num_members"] for row in table])
        if problems:
            raise CheckpointError(
                f"{where}: the ranks hold different things, so their files could never load "
                f"as one checkpoint; nothing was written and the previous checkpoint in "
                f"{directory} is as it was (every rank raises this):\n  - "
                + "\n  - ".join(problems)
                + "\nBuild every rank's stack and optimizer from the same config."
            )
        if shard.world_size == 1:
            return generation
        name, token = table[0]["marker"]
        seen = exchange(_read_marker(directory / name, token), shard, where, "the marker check")
    finally:
        if marker is not None:
            (directory / marker[0]).unlink(missing_ok=True)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        where_is = "; ".join(
            f"rank {r} on {table[r]['host']}: {table[r]['directory']}" for r in range(len(table))
        )
        raise CheckpointError(
            f"{where}: ranks {blind} cannot see the file rank 0 just wrote into the checkpoint "
            f"directory, so the directory is not one shared directory ({where_is}). Without a "
            f"file system every rank sees, the index would name files that exist only on other "
            f"machines and the checkpoint could never load. Nothing was written; pass a path on "
            f"a file system shared by every machine (NFS, Lustre, a mounted bucket), the same "
            f"on every rank."
        )
    return generation


def _write_marker(directory: Path) -> tuple[str, str]:
    token = secrets.token_hex(8)
    name = f".phalanx-shared-{token}"
    atomic_write_text(directory / name, token)
    return name, token


def _read_marker(file: Path, token: str) -> bool:
    try:
        return file.read_text() == token
    except OSError:
        return False


def _layout_problems(shard: Shard, ns: list[int]) -> list[str]:
    """Whether the ranks' blocks, by the Shards they were given, cover every member once."""
    if len(set(ns)) > 1 or shard.world_size == len(ns):
        return []
    return [
        f"this job has {len(ns)} ranks but the Shard says {shard.world_size}; build it with "
        f"phalanx.distributed.shard() or layout(), which read the job's size"
    ]


def _missing_files(directory: Path, shards: list[dict[str, Any]]) -> str | None:
    """Why rank 0 does not see every rank's file as written, or None."""
    for s in shards:
        file = directory / s["file"]
        if not file.is_file() or file.stat().st_size != s["size"]:
            return (
                f"rank 0 does not see {file} as the rank holding members "
                f"{s['start']}..{s['stop'] - 1} wrote it ({s['size']} bytes): the directory is "
                f"not shared by every rank, or another process changed it"
            )
    return None


def _outcome(problem: str | None, shard: Shard, where: str) -> str | None:
    """Rank 0's verdict on the commit, on every rank."""
    return exchange(problem, shard, where, "the commit")[0]


def _remove_superseded(directory: Path, generation: int, listed: set[str]) -> None:
    """After a commit: earlier generations, and files in this one that the index does not name."""
    current = _generation_name(generation)
    for entry in directory.iterdir():
        if GENERATION.fullmatch(entry.name) and entry.name != current and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif OLD_SHARD_FILE.fullmatch(entry.name):
            entry.unlink(missing_ok=True)
    for entry in (directory / current).iterdir():
        if f"{current}/{entry.name}" not in listed and not entry.name.startswith("."):
            entry.unlink(missing_ok=True)
    fsync_directory(directory)


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
    if shard.world_size == 1 or not dist.is_initialized():
        return problem
    table: list[Any] = [None] * shard.world_size
    with collective(where, shard, "all_gather of the file checks"):
        dist.all_gather_object(table, problem)
    return next((f"(found by rank {r}) {p}" for r, p in enumerate(table) if p is not None), None)


def load(
    path: str | os.PathLike[str],
    stack: Stack,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    shard: Shard | None = None,
) -> None:
    """Loads this rank's members (and optimizer state) from a checkpoint of all N members.

    Call it on every rank at the same point. The checkpoint may have been written by any
    number of ranks (a directory from :func:`phalanx.distributed.save`) or by one process (a
    file from :func:`phalanx.save`): each rank reads only the rows of its own global members.
    In a plain process, a stack of all N members loads everything, e.g. to write it again
    with :func:`phalanx.save`. Every file read is checked against the size and SHA-256 the
    index committed, and everything is checked before the stack or optimizer is written: on
    any error nothing is changed, on any rank.

    Args:
        path: a directory written by :func:`phalanx.distributed.save`, or a file written by
            :func:`phalanx.save`.
        stack: this rank's stack, built with the checkpoint's N (e.g. by
            ``phalanx.distributed.shard(factory, num_members=N)``); its tensors are
            overwritten in place.
        optimizer: an optimizer over ``stack.parameters()`` of the saved type, to restore;
            the checkpoint must hold optimizer state then.
        shard: this rank's :class:`Shard`; None for a stack built by
            :func:`phalanx.distributed.shard` or in a plain process.

    Raises:
        FileNotFoundError: ``path`` is neither a checkpoint file nor a directory with an
            index.
        CheckpointError: (a ValueError) a file is missing, truncated, corrupt or not a phalanx
            checkpoint; or the checkpoint has another N, other parameter names, shapes or
            dtypes, another optimizer type, or no optimizer state when one is asked for.

    Example:
        >>> stack, shard = phalanx.distributed.shard(make_member, num_members=8)
        >>> phalanx.distributed.load("ckpt", stack, optimizer=opt)
    """
    from phalanx.distributed._shard import _shards

    where = "phalanx.distributed.load()"
    location = Path(path)
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
    missing, unexpected = sorted(set(own) - source.stack_keys), sorted(source.stack_keys - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: the checkpoint's members have other parameters and buffers than the "
            f"stack's: missing from the checkpoint {missing}, not in the stack {unexpected}. "
            f"Build the members with the architecture that was saved."
        )
    problem = _agree(source.select(shard.global_indices), shard, where)
    if problem is not None:
        raise CheckpointError(
            f"{where}: the checkpoint {location} is damaged: {problem}. A killed save never "
            f"does this (it leaves the previous generation whole); the files were changed or "
            f"lost after the save. Restore the directory from a copy."
        )
    try:
        state = {key: source.stack_rows(key) for key in own}
        optimizer_state = source.optimizer_state() if optimizer is not None else None
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
    if optimizer is not None:
        if optimizer_state is None:
            raise CheckpointError(
                f"{where}: the checkpoint {location} holds no optimizer state; load without "
                f"optimizer=, or save with optimizer=opt."
            )
        check_optimizer(where, str(location), optimizer, optimizer_state, source.optimizer_type)
    # Every check passed: only now is anything written.
    stack.load_state_dict(state)
    if optimizer is not None and optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
