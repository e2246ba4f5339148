"""Checkpoints in safetensors: weights, optimizer, scheduler and data position, no pickle.

One file holds every tensor (keys "stack/...", "optimizer/...", "scheduler/...",
"extra/...") and, in its string metadata, JSON for everything else, with tensors replaced by
{"__tensor__": key}. Loading a file reads numbers and strings only: it cannot run code.

What survives a crash: a save writes a new file beside the old one and renames it over the
old one only when complete (``_files.save_atomic``), so at every instant the path holds the
previous checkpoint or the new one, whole. A load checks everything before it writes
anything (``_checks``), so a failing load changes nothing.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from phalanx.checkpoint._files import read_safetensors, save_atomic, tensors_digest
from phalanx.checkpoint._fit import (
    CheckpointError,
    check_part,
    check_stack,
    decode,
    parse_meta,
    type_name,
)
from phalanx.core._inplace import StackedModuleList
from phalanx.optim import LBFGS

__all__ = ["CheckpointError", "export_members", "load", "read", "restore", "save"]

_FORMAT = "phalanx.checkpoint/1"
DIGEST = "phalanx.sha256"
"""The metadata key of the SHA-256 of the metadata and tensors (``_files.tensors_digest``)."""
_PARTS = ("optimizer", "scheduler", "loader")


def _encode(obj: Any, key: str, tensors: dict[str, Tensor]) -> Any:
    """``obj`` as JSON-able data; its tensors go to ``tensors`` under keys built from ``key``."""
    if isinstance(obj, Tensor):
        # Flat keys can collide ({"val.loss": t} and val={"loss": t} both make
        # "extra.val.loss"): the JSON names the key, so a taken one gets a suffix.
        unique, k = key, 0
        while unique in tensors:
            k += 1
            unique = f"{key}~{k}"
        tensors[unique] = obj.detach()
        return {"__tensor__": unique}
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, list | tuple):
        items = [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, f"{key}.{k}", tensors) for k, v in obj.items()}
        return {
            "__items__": [
                [_encode(k, f"{key}.key{i}", tensors), _encode(v, f"{key}.{k}", tensors)]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    raise TypeError(
        f"phalanx.save(): '{key}' is a {type(obj).__name__}, which a checkpoint cannot hold "
        "without pickle. Checkpoints hold tensors, numbers, strings, None, and lists, tuples "
        "and dicts of them; convert it, or leave it out and rebuild it when loading."
    )


def _num_members(stack: nn.Module) -> int | None:
    n = getattr(stack, "num_members", None)
    return int(n) if n is not None else None


def _member_shapes(stack: nn.Module) -> dict[str, list[list[int]]] | None:
    """A stack padded to the widest (``pad_widths=True``): each member's own shape per
    state-dict key, as JSON holds it; None for a stack of one width."""
    padding = getattr(stack, "padding", None)
    if padding is None:
        return None
    return {f"module.{k}": [list(s) for s in v] for k, v in padding.shapes.items()}


def _check_member_shapes(where: str, path: str, stack: nn.Module, meta: dict[str, Any]) -> None:
    want, got = _member_shapes(stack), meta.get("member_shapes")
    if want == got:
        return
    if want is None or got is None:
        saved = "padded to the widest" if got is not None else "of one width"
        target = "padded to the widest" if want is not None else "of one width"
        raise CheckpointError(
            f"{where}: '{path}' holds a stack {saved} but the stack to load into is {target}; "
            f"build it as the saved one was (phalanx.stack(models, pad_widths=...))."
        )
    bad = [
        f"'{k}' member {i}: saved {tuple(a)}, stack {tuple(b)}"
        for k in sorted(want.keys() | got.keys())
        for i, (a, b) in enumerate(zip(got.get(k, []), want.get(k, [])))
        if a != b
    ] or ["the members' shapes are keyed or counted differently"]
    raise CheckpointError(
        f"{where}: '{path}' holds members of other widths than the stack's:\n  - "
        + "\n  - ".join(bad)
        + "\nBuild the stack from members of the saved widths."
    )


def save(
    path: str | os.PathLike[str],
    stack: nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    loader: Any = None,
    **extra: Any,
) -> None:
    """Saves a training run in one safetensors file, atomically.

    The file is written inside a temporary folder ``.NAME.XXXXXXXX.tmp`` beside ``path``,
    flushed to disk and renamed over ``path`` only when complete: a kill at any instant leaves
    ``path`` holding the previous checkpoint or the new one, whole. Temporaries that killed
    saves of this same ``path`` left behind are removed by the next save.

    Args:
        path: the file to write, conventionally ending in ".safetensors".
        stack: the stack (any module with ``state_dict()``).
        optimizer: an optimizer whose ``state_dict()`` to save, e.g. a phalanx optimizer.
        scheduler: an LR scheduler (torch or ``phalanx.optim.MemberLambdaLR``).
        loader: a ``phalanx.data.MemberLoader``, whose position in the data is saved.
        **extra: more state to keep: tensors, numbers, strings, and lists or dicts of them
            (e.g. ``epoch=3, best=accuracy``). ``load`` returns them.

    Raises:
        TypeError: some state is neither a tensor nor JSON data (e.g. a function).

    Example:
        >>> X, Y = torch.randn(64, 4), torch.randn(64, 1)
        >>> stack = phalanx.stack(lambda: nn.Linear(4, 1), num_members=4)
        >>> opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
        >>> loader = phalanx.data.MemberLoader(X, Y, num_members=4, batch_size=16, seed=0)
        >>> for xb, yb in loader:
        ...     opt.zero_grad()
        ...     losses = phalanx.member_losses(F.mse_loss, stack(xb, in_dims=0), yb, in_dims=(0, 0))
        ...     losses.sum().backward()
        ...     opt.step()
        >>> phalanx.save("run.safetensors", stack, optimizer=opt, loader=loader, epoch=3)
        >>> phalanx.load("run.safetensors", stack, optimizer=opt, loader=loader)
        {'epoch': 3}
    """
    if isinstance(optimizer, LBFGS):
        raise TypeError(
            "phalanx.save(): phalanx.optim.LBFGS keeps one history per member, of different "
            "lengths, which a checkpoint of stacked tensors cannot hold; save the stack "
            "without it (L-BFGS restarts its history cheaply), or torch.save(opt.state_dict())."
        )
    tensors: dict[str, Tensor] = {}
    for key, value in stack.state_dict().items():
        tensors[f"stack/{key}"] = value.detach()
    meta: dict[str, Any] = {"format": _FORMAT, "num_members": _num_members(stack), "types": {}}
    if (shapes := _member_shapes(stack)) is not None:
        meta["member_shapes"] = shapes
    parts = {"optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    for name, obj in parts.items():
        if obj is not None:
            meta[name] = _encode(obj.state_dict(), name, tensors)
            meta["types"][name] = type_name(obj)
    meta["extra"] = _encode(extra, "extra", tensors)

    # safetensors wants contiguous CPU tensors that share no memory: copy views and repeats.
    seen: set[int] = set()
    for key, t in tensors.items():
        t = t.cpu().contiguous()
        if t.numel():
            storage = t.untyped_storage()
            if storage.nbytes() != t.nbytes or storage.data_ptr() in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
        tensors[key] = t
    text = json.dumps(meta)
    # Checked on load: a flipped bit anywhere in the data or the metadata is refused.
    metadata = {"phalanx": text, DIGEST: tensors_digest(text, tensors)}
    save_atomic(tensors, Path(os.path.abspath(os.fspath(path))), metadata, lock=True)


def read(
    path: str, where: str, stack: nn.Module | None = None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The metadata and tensors of a phalanx checkpoint file, or a CheckpointError.

    With ``stack``, a checkpoint whose tensors do not fit it is refused from the header,
    before its data is read (a 1 GB file of another architecture costs nothing).
    """

    def fits(metadata: dict[str, str], shapes: dict[str, Tensor]) -> None:
        if stack is None:
            return
        try:
            meta = json.loads(metadata["phalanx"])
            if meta.get("format") != _FORMAT:
                return
        except (KeyError, ValueError, AttributeError, TypeError, RecursionError):
            return  # the checks after reading say what is wrong with the metadata
        n = meta.get("num_members")
        saved = {k[len("stack/") :]: v for k, v in shapes.items() if k.startswith("stack/")}
        check_stack(where, path, stack, saved, n)

    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{where}: '{path}' does not exist or is not a file; pass a file written by "
            f"phalanx.save() (a directory from phalanx.distributed.save() loads with "
            f"phalanx.distributed.load())."
        )
    try:
        # One open: metadata and tensors come from the same file even when a save renames a
        # new one over `path` meanwhile.
        metadata, tensors = read_safetensors(path, fits)
        raw = metadata.get("phalanx")
    except CheckpointError:
        raise
    except (OSError, ValueError) as e:  # cannot be opened, or not a whole file
        raise CheckpointError(
            f"{where}: '{path}' is not a readable safetensors file; it may be truncated or "
            f"corrupt ({type(e).__name__}: {e})."
        ) from None
    if raw is None:
        raise CheckpointError(
            f"{where}: '{path}' is not a phalanx checkpoint (no 'phalanx' metadata); "
            "write checkpoints with phalanx.save()."
        )
    recorded = metadata.get(DIGEST)  # files saved before checksums have none
    if recorded is not None and recorded != tensors_digest(raw, tensors):
        raise CheckpointError(
            f"{where}: '{path}' is corrupt: its contents do not match the SHA-256 recorded "
            f"when it was saved (damaged on disk or in a copy: a flipped bit, a partial "
            f"transfer). Load an intact copy of it."
        )
    meta = parse_meta(raw, where, path)
    if meta.get("format") != _FORMAT:
        raise CheckpointError(
            f"{where}: '{path}' is not a phalanx checkpoint: format {meta.get('format')!r}, "
            f"expected {_FORMAT!r}."
        )
    n = meta.get("num_members")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise CheckpointError(f"{where}: '{path}' is corrupt: num_members is {n!r}.")
    for name in (*_PARTS, "extra", "types"):
        if name in meta and not isinstance(meta[name], dict):
            raise CheckpointError(
                f"{where}: '{path}' is corrupt: its {name} entry is a "
                f"{type(meta[name]).__name__}, expected an object."
            )
    return meta, tensors


def load(
    path: str | os.PathLike[str],
    stack: nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    loader: Any = None,
) -> dict[str, Any]:
    """Restores a training run saved by ``phalanx.save``; the next step is bit-identical.

    Bit-identical on the same backend: pass ``backend=`` to ``phalanx.stack`` when that matters,
    since under "auto" a resumed stack may pick another backend, which agrees to float
    rounding.

    Everything is checked before anything is changed: the file's integrity, the stack's keys,
    shapes and dtypes, the optimizer's type, structure and hyperparameters (judged by its own
    constructor), the scheduler's and loader's settings. On any error the stack, optimizer,
    scheduler and loader are untouched.

    Args:
        path: a file written by ``phalanx.save``.
        stack: the stack to load into, built like the saved one.
        optimizer, scheduler, loader: objects to restore, built like the saved ones (the
            same types); each must have been saved.

    Returns:
        The ``**extra`` values given to ``save``, tensors on the CPU.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        CheckpointError: (a ValueError) the file is truncated, corrupt or not a phalanx
            checkpoint, lacks a requested part, holds another optimizer or scheduler type, or
            does not fit the stack, optimizer, scheduler or loader. The message names the
            file and every key, expected and got.

    Example:
        >>> X, Y = torch.randn(64, 4), torch.randn(64, 1)
        >>> stack = phalanx.stack(lambda: nn.Linear(4, 1), num_members=4, backend="vmap")
        >>> opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
        >>> loader = phalanx.data.MemberLoader(X, Y, num_members=4, batch_size=16, seed=0)
        >>> phalanx.save("run.safetensors", stack, optimizer=opt, loader=loader, epoch=3)
        >>> stack = phalanx.stack(lambda: nn.Linear(4, 1), num_members=4, backend="vmap")
        >>> opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
        >>> extra = phalanx.load("run.safetensors", stack, optimizer=opt, loader=loader)
        >>> extra["epoch"]
        3
    """
    where = "phalanx.load()"
    path = os.fspath(path)
    meta, tensors = read(path, where, stack)
    return restore(where, path, meta, tensors, stack, optimizer, scheduler, loader)


def restore(
    where: str,
    path: str,
    meta: dict[str, Any],
    tensors: dict[str, Tensor],
    stack: nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    loader: Any = None,
) -> dict[str, Any]:
    """``load`` of a checkpoint already ``read``: checks everything, then writes; the extras."""
    stack_state = {k[len("stack/") :]: v for k, v in tensors.items() if k.startswith("stack/")}
    check_stack(where, path, stack, stack_state, meta.get("num_members"))
    _check_member_shapes(where, path, stack, meta)
    parts = {"optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    types = meta.get("types", {})
    states = {}
    for name, obj in parts.items():
        if obj is None:
            continue
        if name not in meta:
            raise CheckpointError(
                f"{where}: '{path}' holds no {name} state; save it with "
                f"phalanx.save(..., {name}={name}) or do not pass {name}= to load."
            )
        state = decode(meta[name], tensors, where, path, name)
        states[name] = check_part(where, str(path), name, obj, state, types.get(name))
    extra = decode(meta.get("extra", {}), tensors, where, path, "extra")
    # Every check passed: only now is anything written.
    stack.load_state_dict(stack_state)
    for name, state in states.items():
        parts[name].load_state_dict(state)
    return extra


def export_members(stack: nn.Module, indices: Sequence[int] | Tensor) -> list[dict[str, Tensor]]:
    """State dicts of chosen members, each loadable into one ordinary member module.

    Args:
        stack: a stack whose state dict holds (N, ...) tensors (keys may start "module.").
        indices: member indices, e.g. the best k from ``torch.topk(accuracy, k).indices``, or
            an (N,) bool mask.

    Returns:
        One state dict per chosen member, in the order of ``indices``, with the stack's
        "module." prefix removed and tensors copied (they do not alias the stack); in a stack
        built with ``pad_widths=True``, each tensor at the member's own shape.

    Raises:
        IndexError: an index is outside [0, N).

    Example:
        >>> stack = phalanx.stack([nn.Linear(4, 3) for _ in range(8)])
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> best = torch.topk(phalanx.metrics.accuracy(stack(x), y), k=3).indices
        >>> states = phalanx.export_members(stack, best)
        >>> model = nn.Linear(4, 3)
        >>> model.load_state_dict(states[0])
        <All keys matched successfully>
        >>> torch.allclose(model(x), stack(x)[best[0]])
        True
    """
    # A stack in place of a ModuleList writes the list's per-member keys: read the stacked ones.
    state = (
        stack.module.state_dict() if isinstance(stack, StackedModuleList) else stack.state_dict()
    )
    # The members' dropout rates are the stack's, not a tensor of the member's module: each
    # exported member is given its rate by unstack()/stack[i], not by its state dict.
    state = {k: v for k, v in state.items() if not k.startswith("dropout_rates.")}
    n = _num_members(stack)
    if n is None:
        n = next(iter(state.values())).shape[0]
    index = torch.as_tensor(indices)
    if index.dtype == torch.bool:
        index = index.nonzero().flatten()
    index = index.reshape(-1).long()
    bad = [int(i) for i in index if not 0 <= int(i) < n]
    if bad:
        raise IndexError(
            f"phalanx.export_members(): member indices {bad} are out of range for a stack of "
            f"{n} members; valid indices are 0 to {n - 1}."
        )
    prefix = "module." if all(k.startswith("module.") for k in state) else ""
    shapes = _member_shapes(stack) or {}
    out = []
    for i in index.tolist():
        member: dict[str, Tensor] = OrderedDict()
        for key, value in state.items():
            own = shapes.get(key if prefix else f"module.{key}")
            row = value[i] if own is None else value[i][tuple(slice(0, s) for s in own[i])]
            member[key[len(prefix) :]] = row.clone()
        out.append(member)
    return out
