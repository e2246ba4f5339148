"""The save's transaction: the plan every rank agrees to, the marker, the commit's verdict.

Before anything is written the ranks exchange what they hold and rank 0's marker file, so
ranks that disagree, or that do not all see one directory, are refused on every rank with
nothing written. After every rank has written its file, rank 0 checks that it sees them all,
commits (one atomic rename of ``index.json``) and removes the superseded generation; its
verdict is then sent to every rank, so all return or all raise.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from phalanx.checkpoint._files import atomic_write_text, fsync_directory
from phalanx.checkpoint._fit import CheckpointError
from phalanx.distributed._agree import differences, exchange
from phalanx.distributed._mesh import Shard
from phalanx.distributed._sources import GENERATION, INDEX, OLD_SHARD_FILE

__all__ = [
    "file_name",
    "generation_name",
    "missing_files",
    "outcome",
    "preflight",
    "remove_superseded",
]


def file_name(block: range) -> str:
    return f"members-{block.start:06d}-{block.stop:06d}.safetensors"


def generation_name(generation: int) -> str:
    return f"gen-{generation:06d}"


def next_generation(directory: Path) -> int:
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


def is_root(shard: Shard) -> bool:
    """Whether this rank commits: global rank 0, member block 0's replica 0."""
    return shard.rank == 0 and shard.replica == 0


def preflight(
    directory: Path, shard: Shard, facts: dict[str, Any], where: str, rows: str | None = None
) -> int:
    """The generation to write, once every rank holds the same kind of state and sees the
    same directory; otherwise a CheckpointError on every rank, before anything is written.

    Two exchanges: the facts (with rank 0's marker file and generation), then whether each
    rank read the marker. Every rank judges the same table, so all refuse together. ``rows``,
    a digest of this rank's member rows, is compared between the replicas of each block.
    """
    marker = None
    many = dist.is_initialized() and dist.get_world_size() > 1
    if is_root(shard):
        directory.mkdir(parents=True, exist_ok=True)
        facts = {**facts, "generation": next_generation(directory)}
        if many:
            marker = write_marker(directory)
    here = {
        "host": socket.gethostname(),
        "directory": os.path.abspath(directory),
        "block": (shard.start, shard.stop),
        "rows": rows,
    }
    table = exchange({"facts": facts, "marker": marker, **here}, shard, where, "the save's plan")
    try:
        generation = int(table[0]["facts"].pop("generation"))
        problems = differences([row["facts"] for row in table])
        problems += layout_problems(shard, [row["facts"]["num_members"] for row in table])
        problems += replica_problems(table)
        if problems:
            raise CheckpointError(
                f"{where}: the ranks hold different things, so their files could never load "
                f"as one checkpoint; nothing was written and the previous checkpoint in "
                f"{directory} is as it was (every rank raises this):\n  - "
                + "\n  - ".join(problems)
                + "\nBuild every rank's stack and optimizer from the same config."
            )
        if not many:
            return generation
        name, token = table[0]["marker"]
        seen = exchange(read_marker(directory / name, token), shard, where, "the marker check")
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


def write_marker(directory: Path) -> tuple[str, str]:
    token = secrets.token_hex(8)
    name = f".phalanx-shared-{token}"
    atomic_write_text(directory / name, token)
    return name, token


def read_marker(file: Path, token: str) -> bool:
    try:
        return file.read_text() == token
    except OSError:
        return False


def layout_problems(shard: Shard, ns: list[int]) -> list[str]:
    """Whether the ranks' blocks, by the Shards they were given, cover every member once."""
    if len(set(ns)) > 1 or shard.world_size * shard.num_replicas == len(ns):
        return []
    return [
        f"this job has {len(ns)} ranks but the Shard says {shard.world_size} member ranks x "
        f"{shard.num_replicas} replicas; build it with phalanx.distributed.shard() or "
        f"layout() (replicas=R for data replicas), which read the job's size"
    ]


def replica_problems(table: list[dict[str, Any]]) -> list[str]:
    """The member blocks whose data replicas hold different weights (one file per block is
    written, by replica 0, so the others' difference would be lost without a word)."""
    blocks: dict[Any, dict[str, list[int]]] = {}
    for rank, row in enumerate(table):
        if row.get("rows") is not None:
            blocks.setdefault(tuple(row["block"]), {}).setdefault(row["rows"], []).append(rank)
    return [
        f"the data replicas of members {block[0]}..{block[1] - 1} hold different weights or "
        f"optimizer state (ranks grouped by what they hold: {list(seen.values())}); average "
        f"their gradients over shard.replica_group (DDP) so that they stay identical"
        for block, seen in blocks.items()
        if len(seen) > 1
    ]


def missing_files(directory: Path, shards: list[dict[str, Any]]) -> str | None:
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


def outcome(problem: str | None, shard: Shard, where: str) -> str | None:
    """Rank 0's verdict on the commit, on every rank."""
    return exchange(problem, shard, where, "the commit")[0]


def remove_superseded(directory: Path, generation: int, listed: set[str]) -> None:
    """After a commit: earlier generations, and files in this one that the index does not name."""
    current = generation_name(generation)
    for entry in directory.iterdir():
        if GENERATION.fullmatch(entry.name) and entry.name != current and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif OLD_SHARD_FILE.fullmatch(entry.name):
            entry.unlink(missing_ok=True)
    for entry in (directory / current).iterdir():
        if f"{current}/{entry.name}" not in listed and not entry.name.startswith("."):
            entry.unlink(missing_ok=True)
    fsync_directory(directory)
