"""Reading sharded checkpoints: the index, checked for structure, and the files it names.

A directory written by ``phalanx.distributed.save`` is read through :class:`Sharded` (the
committed index, each file verified by size and SHA-256 before it is read); a file written
by ``phalanx.save`` through :class:`SingleFile`. Both give a block of members' rows.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, TypeGuard

import torch
from safetensors import safe_open

from phalanx._torch_compat import pytree
from phalanx.checkpoint._files import checksum, tensors_digest
from phalanx.checkpoint._fit import CheckpointError, decode, parse_meta
from phalanx.checkpoint._single import DIGEST
from phalanx.distributed._parts import MEMBER, REPLICA

__all__ = ["FORMAT", "INDEX", "VERSION", "Sharded", "SingleFile", "read_index"]

FORMAT = "phalanx.distributed.checkpoint"
VERSION = 3  # 3: every part of a run ("parts"); 2: the stack and an optimizer, still read
INDEX = "index.json"
GENERATION = re.compile(r"gen-(\d{6,})")
SHARD_FILE = re.compile(r"gen-\d{6,}/members-\d{6,}-\d{6,}\.safetensors")
OLD_SHARD_FILE = re.compile(r"members-\d{6,}-\d{6,}\.safetensors")  # version 1, flat
STACK = "stack/"
V2_MEMBER, V2_REPLICA = "optim/", "optim-replicated/"  # version 2's optimizer tensors


def _corrupt(file: Path, what: str) -> CheckpointError:
    return CheckpointError(f"phalanx.distributed.load(): {file} is corrupt: {what}.")


def _is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def read_index(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The index of the sharded checkpoint in directory ``path``, checked for structure."""
    where = "phalanx.distributed.load()"
    file = Path(path) / INDEX
    if not file.is_file():
        raise FileNotFoundError(
            f"{where}: {file} does not exist; pass the directory that "
            f"phalanx.distributed.save() wrote (a first save that was interrupted has no "
            f"index), or a file that phalanx.save() wrote."
        )
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise _corrupt(file, f"it cannot be read as text ({e})") from None
    index = parse_meta(text, where, str(file))
    if index.get("format") != FORMAT or index.get("version") not in (2, VERSION):
        raise CheckpointError(
            f"{where}: {file} is not a phalanx.distributed checkpoint index of this version "
            f"(format {index.get('format')!r}, version {index.get('version')!r}); expected "
            f"{FORMAT!r} version {VERSION}."
        )
    n, shards = index.get("num_members"), index.get("shards")
    if not _is_int(n) or n < 1:
        raise _corrupt(file, f"num_members is {n!r}")
    if not isinstance(shards, list) or not shards:
        raise _corrupt(file, "'shards' is not a non-empty list")
    stop = 0
    for k, s in enumerate(shards):
        if not (
            isinstance(s, dict)
            and isinstance(s.get("file"), str)
            and SHARD_FILE.fullmatch(s["file"])
            and all(_is_int(s.get(key)) for key in ("start", "stop", "size"))
            and isinstance(s.get("sha256"), str)
        ):
            raise _corrupt(
                file,
                f"shard {k} is not {{file: 'gen-NNNNNN/members-...', start, stop, size, "
                f"sha256}}: {s!r:.200}",
            )
        if s["start"] != stop or s["stop"] <= s["start"]:
            raise _corrupt(
                file,
                f"shard {k} holds members {s['start']}..{s['stop']}, expected to start at {stop}",
            )
        stop = s["stop"]
    if stop != n:
        raise _corrupt(file, f"its shards hold members 0..{stop}, but num_members is {n}")
    keys = index.get("stack_keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise _corrupt(file, "'stack_keys' is not a list of strings")
    parts = index.get("parts", {})
    if not isinstance(parts, dict) or not all(
        isinstance(part, dict)
        and isinstance(part.get("members"), list)
        and isinstance(part.get("replicas"), list)
        and all(isinstance(k, str) for k in part["members"] + part["replicas"])
        and (part.get("type") is None or isinstance(part.get("type"), str))
        and "state" in part
        for part in parts.values()
    ):
        raise _corrupt(file, "'parts' is not {name: {type, state, members, replicas}}")
    optim = index.get("optimizer")
    if optim is not None and not (
        isinstance(optim, dict)
        and isinstance(optim.get("type"), str)
        and isinstance(optim.get("treespec"), str)
        and isinstance(optim.get("leaves"), list)
        and isinstance(optim.get("member_keys"), list)
    ):
        raise _corrupt(file, "'optimizer' is not {type, treespec, leaves, member_keys}")
    return index


SUPERSEDED = "was committed by a newer save while this load read it"
"""In the problem a load reports when a save removed the generation it was reading."""


def _gone(directory: Path, file: Path) -> str:
    """Why ``file`` is not there: a newer save committed meanwhile (and removed the
    generation this load read), or the file was lost."""
    try:
        now = json.loads((directory / INDEX).read_text())["shards"][0]["file"].split("/")[0]
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        now = None
    if now is not None and now != file.parent.name:
        return (
            f"{file} is gone: generation {now!r} {SUPERSEDED} (the previous one is removed "
            f"once the new one is whole); load again to read the new one"
        )
    return f"{file} is missing"


def _verify(directory: Path, entry: dict[str, Any], full: bool) -> str | None:
    """Why the file ``entry`` names is not the one the index committed, or None."""
    file = directory / entry["file"]
    try:
        # One stat for the kind and the size: a second look (is_file()) could find the file
        # removed by a save that committed meanwhile and call it damaged.
        info = file.stat()
        if not stat.S_ISREG(info.st_mode):
            return f"{file} is not a file"
        size = info.st_size
        if size != entry["size"]:
            return (
                f"{file} has {size} bytes, the index says {entry['size']} (truncated or replaced)"
            )
        if full and checksum(file)[1] != entry["sha256"]:
            return f"{file} does not match the SHA-256 the index recorded (corrupt or replaced)"
    except FileNotFoundError:  # a save that committed meanwhile removed it
        return _gone(directory, file)
    return None


class Sharded:
    """A directory written by :func:`save`: rows of a block read across the shard files."""

    def __init__(self, directory: Path) -> None:
        self.index = read_index(directory)
        self.directory = directory
        self.num_members = int(self.index["num_members"])
        self.stack_keys = set(self.index["stack_keys"])
        self.optimizer_type = (self.index.get("optimizer") or {}).get("type")
        self._files: list[tuple[range, Any]] = []
        self._block = range(0)
        self.generation: str | None = self.index["shards"][0]["file"].split("/")[0]

    def select(self, block: range) -> str | None:
        """Opens the files holding ``block``'s members; why one is not as committed, or None.

        Every file's size is checked; the files this rank reads are checksummed too.
        """
        for entry in self.index["shards"]:
            stored = range(entry["start"], entry["stop"])
            overlaps = max(stored.start, block.start) < min(stored.stop, block.stop)
            problem = _verify(self.directory, entry, full=overlaps)
            if problem is not None:
                return problem
            if overlaps:
                file = self.directory / entry["file"]
                try:
                    # Open, a file stays readable whatever a later save removes.
                    self._files.append((stored, safe_open(str(file), framework="pt")))
                except Exception as e:  # safetensors' own error type
                    if not file.exists():
                        return _gone(self.directory, file)
                    return f"{file} is not a readable safetensors file ({e})"
        self._block = block
        return None

    def rows(self, key: str) -> torch.Tensor:
        pieces = []
        for stored, handle in self._files:
            lo = max(stored.start, self._block.start) - stored.start
            hi = min(stored.stop, self._block.stop) - stored.start
            pieces.append(handle.get_slice(key)[lo:hi])
        return torch.cat(pieces)

    def stack_rows(self, key: str) -> torch.Tensor:
        return self.rows(STACK + key)

    def part_type(self, name: str) -> str | None:
        if self.index["version"] == 2:
            return self.optimizer_type if name == "optimizer" else None
        entry = self.index.get("parts", {}).get(name)
        return None if entry is None else entry.get("type")

    def part(self, name: str) -> Any:
        """The decoded state of a part (``optimizer``, ..., ``extra``), or None if not saved."""
        if self.index["version"] == 2:
            return self._v2_optimizer_state() if name == "optimizer" else None
        entry = self.index.get("parts", {}).get(name)
        if entry is None:
            return None
        rows = _PartTensors(self, set(entry["members"]), set(entry["replicas"]))
        return decode(entry["state"], rows, "phalanx.distributed.load()", str(self.directory), name)

    def _v2_optimizer_state(self) -> dict[str, Any] | None:
        entry = self.index.get("optimizer")
        if entry is None:
            return None
        members = set(entry["member_keys"])
        leaves = []
        for leaf in entry["leaves"]:
            if isinstance(leaf, dict):
                key = leaf["tensor"]
                # Replicated tensors are the same in every file: read the first one's.
                leaf = (
                    self.rows(V2_MEMBER + key) if key in members else self.replica(V2_REPLICA + key)
                )
            leaves.append(leaf)
        return pytree.tree_unflatten(leaves, pytree.treespec_loads(entry["treespec"]))

    def replica(self, key: str) -> torch.Tensor:
        return self._files[0][1].get_tensor(key)


class _PartTensors:
    """A part's tensors by the keys its JSON names: this block's rows, or the one replica."""

    def __init__(self, source: Sharded, members: set[str], replicas: set[str]) -> None:
        self.source, self.members, self.replicas = source, members, replicas

    def __contains__(self, key: str) -> bool:
        return key in self.members or key in self.replicas

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.members:
            return self.source.rows(MEMBER + key)
        return self.source.replica(REPLICA + key)


class SingleFile:
    """A file written by :func:`phalanx.save` in one process: every member's rows in one file."""

    def __init__(self, file: Path, where: str) -> None:
        self.path = str(file)
        try:
            self.file = safe_open(self.path, framework="pt")
            raw = (self.file.metadata() or {}).get("phalanx")
        except Exception as e:  # safetensors' own error type
            raise CheckpointError(
                f"{where}: {file} is not a readable safetensors file; it may be truncated or "
                f"corrupt ({type(e).__name__}: {e})."
            ) from None
        if raw is None:
            raise CheckpointError(
                f"{where}: {file} is not a phalanx checkpoint (no 'phalanx' metadata); pass a "
                f"directory written by phalanx.distributed.save() or a file by phalanx.save()."
            )
        self.meta = parse_meta(raw, where, self.path)
        self.keys = set(self.file.keys())  # a safetensors handle is not iterable
        self.stack_keys = {k[len(STACK) :] for k in self.keys if k.startswith(STACK)}
        n = self.meta.get("num_members")
        if n is None and self.stack_keys:
            n = self.file.get_slice(STACK + min(self.stack_keys)).get_shape()[0]
        if not _is_int(n) or n < 1:
            raise CheckpointError(f"{where}: {file} is corrupt: num_members is {n!r}.")
        self.num_members: int = n
        types = self.meta.get("types")
        self.optimizer_type = types.get("optimizer") if isinstance(types, dict) else None
        self._block = range(0)
        self._where = where
        self.generation: str | None = None
        recorded = (self.file.metadata() or {}).get(DIGEST)  # files saved before have none
        if recorded is not None:
            tensors = {k: self.file.get_tensor(k) for k in self.keys}
            if recorded != tensors_digest(raw, tensors):
                raise CheckpointError(
                    f"{where}: {file} is corrupt: its contents do not match the SHA-256 "
                    f"recorded when it was saved (damaged on disk or in a copy). Load an "
                    f"intact copy of it."
                )

    def select(self, block: range) -> str | None:
        self._block = block
        return None

    def stack_rows(self, key: str) -> torch.Tensor:
        return self.file.get_slice(STACK + key)[self._block.start : self._block.stop]

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def __getitem__(self, key: str) -> torch.Tensor:
        """A tensor of the optimizer state: this block's rows when it carries the members."""
        shape = self.file.get_slice(key).get_shape()
        if shape and shape[0] == self.num_members:
            return self.file.get_slice(key)[self._block.start : self._block.stop]
        return self.file.get_tensor(key)

    def part_type(self, name: str) -> str | None:
        types = self.meta.get("types")
        return types.get(name) if isinstance(types, dict) else None

    def part(self, name: str) -> Any:
        """The decoded state of a part (``optimizer``, ..., ``extra``), or None if not saved."""
        if name not in self.meta:
            return None
        return decode(self.meta[name], self, self._where, self.path, name)
