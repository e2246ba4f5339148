"""Files that a kill at any instant leaves either complete or absent, and tidying after kills.

A file is written inside a private temporary directory next to its destination, named
``.NAME.XXXXXXXX.tmp`` (NAME is the destination's name, X are ``tempfile`` characters), then
flushed to disk and renamed over the destination in one atomic step. safetensors writes
through a temporary file of its own (``.tmpXXXXXX``, whose name says nothing about the
checkpoint); putting it inside our directory means the one name proves what every leftover
belongs to, so a later save of the same checkpoint can remove what killed saves left.

Two processes may ``phalanx.save`` to one path at once: each such save holds an exclusive lock on
``.NAME.lock`` beside the destination (``fcntl.flock``; the file is kept, since deleting a
lock file races with its next user) from tidying to rename, so savers take turns, every
temporary present while the lock is held belongs to a dead saver, and the path always holds
one whole checkpoint, the last one renamed. Readers need no lock: a rename is atomic, and a
reader that reads one open file sees one checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import safetensors.torch
import torch
from torch import Tensor

__all__ = [
    "atomic_write_text",
    "checksum",
    "fsync_directory",
    "path_lock",
    "read_safetensors",
    "remove_litter",
    "save_atomic",
]

_CHUNK = 1 << 22


def _litter(name: str) -> re.Pattern[str]:
    """Names of temporaries of the file ``name``: exactly what ``tempfile`` makes for it."""
    return re.compile(re.escape(f".{name}.") + r"[a-z0-9_]{8}\.tmp")


@contextlib.contextmanager
def path_lock(path: Path) -> Iterator[None]:
    """Holds the exclusive lock of the destination ``path`` (``.NAME.lock`` beside it).

    Where ``fcntl`` is missing (Windows) nothing is locked: saves to one path must then not
    overlap.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(path.parent / f".{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock, also when the process dies


def remove_litter(directory: Path, name: str) -> list[str]:
    """Removes what killed saves of ``directory / name`` left behind; returns their names.

    Only entries whose names are ``.NAME.XXXXXXXX.tmp`` are touched: files and folders made by
    this module for that one destination. Call it holding ``path_lock(directory / name)``,
    so that no live save's temporaries are among them.
    """
    pattern = _litter(name)
    removed = []
    for entry in directory.iterdir() if directory.is_dir() else ():
        if not pattern.fullmatch(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return removed


def fsync_directory(directory: Path) -> None:
    """Makes renames and deletions in ``directory`` durable; not possible on every platform."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checksum(path: Path) -> tuple[int, str]:
    """The size in bytes and the SHA-256 (hex) of a file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def tensors_digest(text: str, tensors: dict[str, Tensor]) -> str:
    """The SHA-256 (hex) of ``text`` and of ``tensors``' names, dtypes, shapes and bytes,
    in name order: what a file's data must still be when it is read back."""
    digest = hashlib.sha256(text.encode())
    for key in sorted(tensors):
        t = tensors[key]
        digest.update(f"\0{key}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        if t.numel():
            flat = t.detach().cpu().contiguous().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def save_atomic(
    tensors: dict[str, Tensor], path: Path, metadata: dict[str, str], *, lock: bool = False
) -> tuple[int, str]:
    """Writes a safetensors file at ``path`` atomically; returns its size and SHA-256.

    Leftovers of earlier killed saves of ``path`` are removed first. On any error (a
    KeyboardInterrupt included) the temporary directory is removed and ``path`` is as before.
    With ``lock``, the save holds ``path_lock(path)`` throughout, so concurrent savers of one
    path take turns (``phalanx.save``); without, one saver per path at a time is the caller's
    contract (a sharded save's files, each written by one rank).
    """
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    with path_lock(path) if lock else contextlib.nullcontext():
        remove_litter(directory, path.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory))
        try:
            part = tmp / "data"
            safetensors.torch.save_file(tensors, str(part), metadata=metadata)
            with open(part, "rb") as f:
                os.fsync(f.fileno())
            size, digest = checksum(part)
            os.replace(part, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_directory(directory)
    return size, digest


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    **{
        name: getattr(torch, attr)
        for name, attr in (
            ("U16", "uint16"),
            ("U32", "uint32"),
            ("U64", "uint64"),
            ("F8_E4M3", "float8_e4m3fn"),
            ("F8_E5M2", "float8_e5m2"),
        )
        if hasattr(torch, attr)
    },
}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def read_safetensors(
    path: str | os.PathLike[str],
    before_data: Callable[[dict[str, str], dict[str, Tensor]], None] | None = None,
) -> tuple[dict[str, str], dict[str, Tensor]]:
    """The metadata and tensors of a safetensors file, both from one open of it.

    safetensors' own reader opens the file again for the tensors (by name), so a save renamed
    over the path in between gave one file's metadata with another's tensors. Here the file
    is opened once and mapped: a rename then changes nothing for this read.

    Args:
        path: the file.
        before_data: called with the metadata and the tensors' shapes and dtypes (as "meta"
            tensors) before any data is read: it may refuse a file cheaply, by raising.

    Raises:
        OSError: the file cannot be opened.
        ValueError: it is not a whole safetensors file (truncated, corrupt header).
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{size} bytes, shorter than a safetensors header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            length = int.from_bytes(view[:8], "little")
            if length > min(size - 8, _MAX_HEADER):
                raise ValueError(f"its header claims {length} bytes; the file has {size}")
            try:
                header = json.loads(view[8 : 8 + length])
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"its header is not JSON ({e})") from None
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
            metadata = header.pop("__metadata__", None) or {}
            if not isinstance(metadata, dict) or not all(
                isinstance(v, str) for v in metadata.values()
            ):
                raise ValueError("its metadata is not a map of strings")
            base = 8 + length
            if before_data is not None:
                before_data(
                    metadata,
                    {k: _tensor(view, base, size, k, v, data=False) for k, v in header.items()},
                )
            tensors = {k: _tensor(view, base, size, k, v) for k, v in header.items()}
    return metadata, tensors


def _tensor(
    view: mmap.mmap, base: int, size: int, name: str, info: object, *, data: bool = True
) -> Tensor:
    """One tensor of a mapped safetensors file, copied out, after checking its extent; with
    ``data=False`` only its shape and dtype, as a "meta" tensor."""
    try:
        dtype = _DTYPES[info["dtype"]]  # type: ignore[index]
        shape = [int(d) for d in info["shape"]]  # type: ignore[index]
        start, end = (int(o) for o in info["data_offsets"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"tensor {name!r} has a malformed entry ({e!r})") from None
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if min(shape, default=0) < 0 or not 0 <= start <= end <= size - base or end - start != nbytes:
        raise ValueError(
            f"tensor {name!r} ({shape}, {info['dtype']}) does not fit its bytes "  # type: ignore[index]
            f"{start}..{end} of {size - base}"
        )
    if not data:
        return torch.empty(shape, dtype=dtype, device="meta")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    raw = bytearray(view[base + start : base + end])  # a copy: the map closes after reading
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


def atomic_write_text(path: Path, text: str, *, lock: bool = False) -> None:
    """Writes a small text file atomically (temporary file, fsync, rename, fsync directory)."""
    with path_lock(path) if lock else contextlib.nullcontext():
        remove_litter(path.parent, path.name)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_directory(path.parent)
