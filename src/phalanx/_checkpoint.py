"""Checkpoints in safetensors: weights, optimizer, scheduler and data position, no pickle.

One file holds every tensor (keys "stack/...", "optimizer/...", "scheduler/...",
"extra/...") and, in its string metadata, JSON for everything else, with tensors replaced by
{"__tensor__": key}. Loading a file reads numbers and strings only: it cannot run code.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import safetensors.torch
import torch
from torch import Tensor, nn

__all__ = ["export_members", "load", "save"]

_FORMAT = "phalanx.checkpoint/1"
_SECTIONS = ("optimizer", "scheduler", "loader", "extra")


def _encode(obj: Any, key: str, tensors: dict[str, Tensor]) -> Any:
    """`obj` as JSON-able data; its tensors go to `tensors` under keys built from `key`."""
    if isinstance(obj, Tensor):
        tensors[key] = obj.detach()
        return {"__tensor__": key}
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


def _decode(obj: Any, tensors: dict[str, Tensor]) -> Any:
    """The inverse of `_encode`."""
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__float__" in obj:
            return float(obj["__float__"])
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        if "__items__" in obj:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


def _num_members(stack: nn.Module) -> int | None:
    n = getattr(stack, "num_members", None)
    return int(n) if n is not None else None


def save(
    path: str | os.PathLike[str],
    stack: nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    loader: Any = None,
    **extra: Any,
) -> None:
    """Saves a training run in one safetensors file, atomically.

    The file is written to a temporary file in the same directory and renamed over `path`
    only when complete, so a crash while saving leaves the previous checkpoint intact.

    Args:
        path: the file to write, conventionally ending in ".safetensors".
        stack: the stack (any module with `state_dict()`).
        optimizer: an optimizer whose `state_dict()` to save, e.g. a phalanx optimizer.
        scheduler: an LR scheduler (torch or `phalanx.optim.MemberLambdaLR`).
        loader: a `phalanx.data.MemberLoader`, whose position in the data is saved.
        **extra: more state to keep: tensors, numbers, strings, and lists or dicts of them
            (e.g. `epoch=3, best=accuracy`). `load` returns them.

    Raises:
        TypeError: some state is neither a tensor nor JSON data (e.g. a function).

    Example:
        >>> phalanx.save("run.safetensors", stack, optimizer=opt, loader=loader, epoch=3)
    """
    tensors: dict[str, Tensor] = {}
    for key, value in stack.state_dict().items():
        tensors[f"stack/{key}"] = value.detach()
    meta: dict[str, Any] = {"format": _FORMAT, "num_members": _num_members(stack)}
    parts = {"optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    for name, obj in parts.items():
        if obj is not None:
            meta[name] = _encode(obj.state_dict(), name, tensors)
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
    metadata = {"phalanx": json.dumps(meta)}

    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        safetensors.torch.save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable; not possible on every platform
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def _check_stack(path: str, stack: nn.Module, saved: dict[str, Tensor], n_saved: Any) -> None:
    """Raises one error listing every key whose presence or shape differs."""
    expected = stack.state_dict()
    problems = []
    for key, value in expected.items():
        if key not in saved:
            problems.append(f"key '{key}' is missing from the checkpoint")
        elif tuple(saved[key].shape) != tuple(value.shape):
            problems.append(
                f"key '{key}' expected shape {tuple(value.shape)} (this stack), "
                f"got {tuple(saved[key].shape)} (checkpoint)"
            )
    problems += [
        f"key '{k}' is in the checkpoint but not in this stack" for k in saved if k not in expected
    ]
    if problems:
        n = _num_members(stack)
        sizes = f" The checkpoint holds {n_saved} members, this stack {n}." if n != n_saved else ""
        raise ValueError(
            f"phalanx.load(): checkpoint '{path}' does not fit this stack: "
            + "; ".join(problems)
            + f".{sizes} Build the stack with the architecture and number of members it was "
            "saved with."
        )


def _check_optimizer(path: str, optimizer: Any, saved: dict[str, Any]) -> None:
    """Raises one error listing every optimizer group or state tensor that does not fit."""
    groups = optimizer.param_groups
    saved_groups = saved["param_groups"]
    problems = []
    if len(groups) != len(saved_groups):
        problems.append(f"{len(saved_groups)} param groups saved, {len(groups)} in the optimizer")
    params = [p for g in groups for p in g["params"]]
    for g, (group, saved_group) in enumerate(zip(groups, saved_groups, strict=False)):
        if len(group["params"]) != len(saved_group["params"]):
            problems.append(
                f"param group {g} has {len(group['params'])} parameters, "
                f"{len(saved_group['params'])} saved"
            )
    for index, state in saved["state"].items():
        if not 0 <= index < len(params):
            problems.append(f"state of parameter {index}, which the optimizer does not have")
            continue
        shape = tuple(params[index].shape)
        for key, value in state.items():
            if not isinstance(value, Tensor) or value.dim() == 0:
                continue
            want = shape if value.dim() == len(shape) else shape[:1]
            if tuple(value.shape) != want:
                problems.append(
                    f"key 'optimizer.state.{index}.{key}' expected shape {want}, "
                    f"got {tuple(value.shape)}"
                )
    if problems:
        raise ValueError(
            f"phalanx.load(): the optimizer state in '{path}' does not fit this optimizer: "
            + "; ".join(problems)
            + ". Build the optimizer over the same stack and parameter groups it was saved with."
        )


def load(
    path: str | os.PathLike[str],
    stack: nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    loader: Any = None,
) -> dict[str, Any]:
    """Restores a training run saved by `phalanx.save`; the next step is bit-identical.

    Everything is checked before anything is changed: on an error the stack, optimizer,
    scheduler and loader are untouched.

    Args:
        path: a file written by `phalanx.save`.
        stack: the stack to load into, built like the saved one.
        optimizer, scheduler, loader: objects to restore, built like the saved ones; each
            must have been saved.

    Returns:
        The `**extra` values given to `save`, tensors on the CPU.

    Raises:
        ValueError: the file is not a phalanx checkpoint, lacks a requested part, or does not
            fit the stack or optimizer (the message names every key, expected and got).

    Example:
        >>> extra = phalanx.load("run.safetensors", stack, optimizer=opt, loader=loader)
        >>> extra["epoch"]
        3
    """
    path = os.fspath(path)
    with safetensors.safe_open(path, framework="pt") as f:
        raw = (f.metadata() or {}).get("phalanx")
    if raw is None:
        raise ValueError(
            f"phalanx.load(): '{path}' is not a phalanx checkpoint (no 'phalanx' metadata); "
            "write checkpoints with phalanx.save()."
        )
    meta = json.loads(raw)
    tensors = safetensors.torch.load_file(path)
    stack_state = {k[len("stack/") :]: v for k, v in tensors.items() if k.startswith("stack/")}
    _check_stack(path, stack, stack_state, meta.get("num_members"))
    parts = {"optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    states = {}
    for name, obj in parts.items():
        if obj is None:
            continue
        if name not in meta:
            raise ValueError(
                f"phalanx.load(): '{path}' holds no {name} state; save it with "
                f"phalanx.save(..., {name}={name}) or do not pass {name}= to load."
            )
        states[name] = _decode(meta[name], tensors)
    if optimizer is not None:
        _check_optimizer(path, optimizer, states["optimizer"])
    stack.load_state_dict(stack_state)
    for name, state in states.items():
        parts[name].load_state_dict(state)
    return _decode(meta.get("extra", {}), tensors)


def export_members(stack: nn.Module, indices: Sequence[int] | Tensor) -> list[dict[str, Tensor]]:
    """State dicts of chosen members, each loadable into one ordinary member module.

    Args:
        stack: a stack whose state dict holds (N, ...) tensors (keys may start "module.").
        indices: member indices, e.g. the best k from `torch.topk(accuracy, k).indices`, or
            an (N,) bool mask.

    Returns:
        One state dict per chosen member, in the order of `indices`, with the stack's
        "module." prefix removed and tensors copied (they do not alias the stack).

    Raises:
        IndexError: an index is outside [0, N).

    Example:
        >>> best = torch.topk(phalanx.metrics.accuracy(stack(x), y), k=3).indices
        >>> states = phalanx.export_members(stack, best)
        >>> model.load_state_dict(states[0])
    """
    state = stack.state_dict()
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
    out = []
    for i in index.tolist():
        member: dict[str, Tensor] = OrderedDict()
        for key, value in state.items():
            member[key[len(prefix) :]] = value[i].clone()
        out.append(member)
    return out
