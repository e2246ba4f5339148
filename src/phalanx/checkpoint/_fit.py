"""What a checkpoint must satisfy before anything is loaded from it; one error type for all.

A load reads the whole file, decodes it strictly and checks it against every object it is
to be loaded into (the stack, the optimizer, the scheduler, the loader) before it writes any
of them, so that a failing load changes nothing. Files are data from outside: any way they
can be malformed ends in a :class:`CheckpointError` naming the file and what is wrong, never
in a raw ``KeyError``, ``TypeError`` or ``RecursionError`` from deep inside.
"""

from __future__ import annotations

import copy
import inspect
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "CheckpointError",
    "check_like",
    "check_optimizer",
    "check_stack",
    "decode",
    "parse_meta",
    "probe_load",
    "type_name",
]

# JSON nested deeper than this is not something phalanx wrote: optimizer and scheduler
# states are a few levels deep.
MAX_DEPTH = 64


class CheckpointError(ValueError):
    """A checkpoint is unreadable, corrupt, or does not fit what it is loaded into.

    The message names the file and what is wrong with it. Nothing was loaded.
    """


def type_name(obj: Any) -> str:
    """The type of ``obj`` by its public name (``phalanx.optim.Adam``, ``torch.optim.Adam``),
    recorded so that loads can compare it: the shortest package path that exports it."""
    cls = type(obj)
    parts = cls.__module__.split(".")
    for k in range(1, len(parts)):
        package = sys.modules.get(".".join(parts[:k]))
        if package is not None and getattr(package, cls.__qualname__, None) is cls:
            return f"{'.'.join(parts[:k])}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def parse_meta(raw: Any, where: str, path: str) -> dict[str, Any]:
    """The JSON metadata of a checkpoint, as a dict; a clear error for anything else."""
    if not isinstance(raw, str):
        raise CheckpointError(f"{where}: '{path}' has no phalanx metadata string.")
    try:
        meta = json.loads(raw)
    except RecursionError:
        raise CheckpointError(
            f"{where}: '{path}' is corrupt: its metadata nests too deeply to be a phalanx "
            f"checkpoint."
        ) from None
    except ValueError as e:
        raise CheckpointError(
            f"{where}: '{path}' is corrupt: its metadata is not valid JSON ({e})."
        ) from None
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"{where}: '{path}' is corrupt: its metadata is a JSON {type(meta).__name__}, "
            f"expected an object."
        )
    return meta


def decode(obj: Any, tensors: Any, where: str, path: str, at: str = "", depth: int = 0) -> Any:
    """The inverse of the checkpoint's encoding, refusing anything it never writes.

    ``tensors`` maps keys to tensors (a dict, or any object with ``__getitem__`` and
    ``__contains__``); ``at`` is where in the metadata ``obj`` sits, for messages.
    """

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: '{path}' is corrupt: {at or 'the metadata'} {what}.")

    if depth > MAX_DEPTH:
        raise bad(f"nests more than {MAX_DEPTH} levels deep")
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, list):
        return [decode(v, tensors, where, path, f"{at}[{i}]", depth + 1) for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        raise bad(f"holds a {type(obj).__name__}")
    tags = [k for k in obj if k in {"__tensor__", "__float__", "__tuple__", "__items__"}]
    if tags and len(obj) != 1:
        raise bad(f"mixes the tag {tags[0]!r} with other keys {sorted(obj)}")
    if "__tensor__" in obj:
        key = obj["__tensor__"]
        if not isinstance(key, str) or key not in tensors:
            raise bad(f"names a tensor {key!r} that the file does not hold")
        return tensors[key]
    if "__float__" in obj:
        text = obj["__float__"]
        if text not in {"inf", "-inf", "nan"}:
            raise bad(f"holds a non-finite float written as {text!r}")
        return float(text)
    if "__tuple__" in obj:
        items = obj["__tuple__"]
        if not isinstance(items, list):
            raise bad("holds a tuple that is not a list")
        return tuple(
            decode(v, tensors, where, path, f"{at}[{i}]", depth + 1) for i, v in enumerate(items)
        )
    if "__items__" in obj:
        pairs = obj["__items__"]
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 for p in pairs
        ):
            raise bad("holds a mapping that is not a list of [key, value] pairs")
        out = {}
        for i, (k, v) in enumerate(pairs):
            key = decode(k, tensors, where, path, f"{at}.key{i}", depth + 1)
            if not isinstance(key, bool | int | float | str | tuple | type(None)):
                raise bad(f"holds a mapping key of type {type(key).__name__}")
            out[key] = decode(v, tensors, where, path, f"{at}[{key!r}]", depth + 1)
        return out
    return {
        k: decode(v, tensors, where, path, f"{at}.{k}" if at else k, depth + 1)
        for k, v in obj.items()
    }


def _shape(t: Tensor) -> str:
    dims = tuple(t.shape)
    return "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"


_RATES = "dropout_rates."


def check_stack(
    where: str, path: str, stack: nn.Module, saved: dict[str, Tensor], n_saved: Any
) -> None:
    """Raises one error listing every key whose presence, shape or dtype differs."""
    # The members' dropout rates (``dropout_rates.<path>``) are there only where they differ
    # between members; the stack's load takes them, or gives every member one rate.
    expected = {k: v for k, v in stack.state_dict().items() if not k.startswith(_RATES)}
    saved = {k: v for k, v in saved.items() if not k.startswith(_RATES)}
    problems = []
    for key, value in expected.items():
        if key not in saved:
            problems.append(f"key '{key}' is missing from the checkpoint")
        elif saved[key].shape != value.shape:
            problems.append(
                f"key '{key}' expected shape {tuple(value.shape)} (this stack), "
                f"got {tuple(saved[key].shape)} (checkpoint)"
            )
        elif saved[key].dtype != value.dtype:
            problems.append(
                f"key '{key}' expected dtype {value.dtype} (this stack), got "
                f"{saved[key].dtype} (checkpoint)"
            )
    problems += [
        f"key '{k}' is in the checkpoint but not in this stack" for k in saved if k not in expected
    ]
    if problems:
        n = getattr(stack, "num_members", None)
        sizes = f" The checkpoint holds {n_saved} members, this stack {n}." if n != n_saved else ""
        raise CheckpointError(
            f"{where}: checkpoint '{path}' does not fit this stack: "
            + "; ".join(problems)
            + f".{sizes} Build the stack with the architecture, dtype and number of members it "
            "was saved with."
        )


def _kind(v: Any) -> str:
    if v is None:
        return "None"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, Tensor):
        return "tensor"
    if isinstance(v, list | tuple):
        return type(v).__name__
    if isinstance(v, dict):
        return "dict"
    return type(v).__name__


def check_like(current: Any, saved: Any, at: str, *, keys: bool = True) -> list[str]:
    """Every way ``saved`` differs in structure from ``current``: keys, lengths, kinds,
    tensor shapes and dtypes. Values may differ; a number may be an int or a float, and where
    ``current`` is None (not set yet in a fresh object) the saved value may be anything.

    With ``keys=False`` a top-level key that only one side has is no difference: the state of
    a torch object (a scheduler), whose private keys change between torch releases and whose
    own ``load_state_dict`` takes them all, is judged by that load (``probe_load``)."""
    if current is None:
        return []
    kc, ks = _kind(current), _kind(saved)
    if kc != ks:
        shown = repr(saved) if ks in {"str", "number", "bool", "None"} else ks
        return [f"{at} is {shown}, expected a {kc}"]
    if isinstance(current, Tensor):
        if current.shape != saved.shape or current.dtype != saved.dtype:
            return [
                f"{at} is a {saved.dtype} tensor of shape {_shape(saved)}, expected "
                f"{current.dtype} {_shape(current)}"
            ]
        return []
    if isinstance(current, list | tuple):
        if len(current) != len(saved):
            return [f"{at} has {len(saved)} entries, expected {len(current)}"]
        return [
            d
            for i, (c, s) in enumerate(zip(current, saved))
            for d in check_like(c, s, f"{at}[{i}]")
        ]
    if isinstance(current, dict):
        out = [f"{at} lacks {k!r}" for k in current if k not in saved and keys]
        out += [f"{at} has an unexpected {k!r}" for k in saved if k not in current and keys]
        return out + [
            d
            for k in current
            if k in saved
            for d in check_like(current[k], saved[k], f"{at}[{k!r}]")
        ]
    return []


def probe_load(where: str, path: str, name: str, obj: Any, state: dict[str, Any]) -> None:
    """Runs ``obj.load_state_dict(state)`` on a shallow copy, so its own checks run first.

    Schedulers and loaders rebind attributes when they load (they mutate nothing in place),
    so a shallow copy takes the load and ``obj`` is untouched.
    """
    probe = copy.copy(obj)
    try:
        probe.load_state_dict(state)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError) as e:
        raise CheckpointError(
            f"{where}: the {name} state in '{path}' does not fit this {name}: {e}"
        ) from e


# ------------------------------------------------------------------------------- optimizers


def _compatible(current: Any, saved: Any) -> bool:
    """A hyperparameter may change value and be a number or a per-member tensor; no more."""
    kinds = {_kind(current), _kind(saved)}
    return len(kinds) == 1 or "None" in kinds or kinds in ({"number", "tensor"}, {"bool", "tensor"})


def _construct(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """Builds a throw-away optimizer of the same type from a saved group's hyperparameters.

    The constructor's own checks then judge the saved values exactly as they judge a user's.
    """
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in group.items() if k in accepted and k not in {"self", "params"}}
    first = optimizer.param_groups[0]["params"][0]
    n = getattr(optimizer, "num_members", None)
    shape = (n, 1) if isinstance(n, int) and n > 0 else (1,)
    scratch = torch.zeros(shape, dtype=first.dtype, device=first.device, requires_grad=True)
    cls([scratch], **kwargs)
    if group.get("member_lr") is not None and "lr" in accepted:
        cls([scratch], **{**kwargs, "lr": group["member_lr"]})


def check_optimizer(where: str, path: str, optimizer: Any, saved: Any, saved_type: Any) -> None:
    """Raises one error listing everything in a saved optimizer state that does not fit."""
    mine = type_name(optimizer)
    if saved_type != mine:
        raise CheckpointError(
            f"{where}: '{path}' holds the state of a {saved_type} optimizer, but a {mine} was "
            f"given. Optimizer states do not carry over between types; build a {saved_type}, "
            f"or load without optimizer= and start the optimizer afresh."
        )
    if not (
        isinstance(saved, dict)
        and isinstance(saved.get("state"), dict)
        and isinstance(saved.get("param_groups"), list)
        and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved["param_groups"]
        )
    ):
        raise CheckpointError(
            f"{where}: '{path}' is corrupt: its optimizer state lacks 'state' (a mapping) or "
            f"'param_groups' (a list of groups, each with 'params')."
        )
    current = optimizer.state_dict()
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    problems = []
    if len(groups) != len(saved_groups):
        problems.append(f"{len(saved_groups)} param groups saved, {len(groups)} in the optimizer")
    params = [p for g in groups for p in g["params"]]
    ids = [i for g in current["param_groups"] for i in g["params"]]
    for g, (group, saved_group, now) in enumerate(
        zip(groups, saved_groups, current["param_groups"])
    ):
        if saved_group["params"] != now["params"]:
            problems.append(
                f"param group {g} has {len(group['params'])} parameters, "
                f"{len(saved_group['params'])} saved"
            )
        for key in now.keys() | saved_group.keys():
            if key == "params":
                continue
            if key not in saved_group or key not in now:
                # torch's own optimizers fill a key missing from a saved group with its default
                # (__setstate__) and keep one they do not know: a state saved under another
                # torch release loads there, so it loads here. phalanx's keys are its own.
                if not mine.startswith("phalanx."):
                    continue
                where_missing = "the checkpoint" if key not in saved_group else "this optimizer"
                problems.append(
                    f"param group {g} hyperparameter {key!r} is missing from {where_missing}"
                )
            elif not _compatible(now[key], saved_group[key]):
                problems.append(
                    f"param group {g} hyperparameter {key!r} is {saved_group[key]!r}, expected a "
                    f"{_kind(now[key])} like {now[key]!r}"
                )
        if not problems:
            try:
                _construct(optimizer, saved_group)
            except (ValueError, TypeError, RuntimeError) as e:
                problems.append(f"param group {g} hyperparameters are refused by {mine}(): {e}")
    for index, state in saved["state"].items():
        if index not in ids or not isinstance(state, dict):
            problems.append(f"state of parameter {index!r}, which the optimizer does not have")
            continue
        param = params[ids.index(index)]
        for key, value in state.items():
            at = f"'optimizer.state.{index}.{key}'"
            if not isinstance(value, Tensor):
                if not isinstance(value, int | float) or isinstance(value, bool):
                    problems.append(f"key {at} is {value!r}, expected a tensor or a number")
                continue
            if value.dim() == 0:
                if key == "step" and not value.is_floating_point():
                    problems.append(f"key {at} has dtype {value.dtype}, expected a float dtype")
                continue
            want = param.shape if value.dim() == param.dim() else param.shape[:1]
            if value.shape != want:
                problems.append(f"key {at} expected shape {tuple(want)}, got {tuple(value.shape)}")
            elif key == "step":
                if not value.is_floating_point():
                    problems.append(f"key {at} has dtype {value.dtype}, expected a float dtype")
            elif value.shape == param.shape and value.dtype != param.dtype:
                problems.append(f"key {at} expected dtype {param.dtype}, got {value.dtype}")
    extra = {k: v for k, v in saved.items() if k not in {"state", "param_groups"}}
    now_extra = {k: v for k, v in current.items() if k not in {"state", "param_groups"}}
    problems += check_like(
        now_extra, extra, "the optimizer state", keys=mine.startswith("phalanx.")
    )
    if problems:
        raise CheckpointError(
            f"{where}: the optimizer state in '{path}' does not fit this optimizer: "
            + "; ".join(problems)
            + ". Build the optimizer over the same stack and parameter groups it was saved with."
        )


def check_part(
    where: str,
    location: str,
    name: str,
    obj: Any,
    state: Any,
    kind: str | None,
    adapt: Callable[[dict], dict] | None = None,
) -> dict:
    """A saved optimizer, scheduler or loader state, checked against the object it will load
    into (its type, its keys and shapes, a trial load), before anything is written.

    ``adapt`` turns the saved state into what ``obj`` takes (a sharded loader's global
    position into this rank's) after the type check. Returns the state to load.
    """
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{where}: '{location}' is corrupt: its {name} state is not a mapping."
        )
    if name == "optimizer":
        check_optimizer(where, location, obj, state, kind)
        return state
    if kind != type_name(obj):
        raise CheckpointError(
            f"{where}: '{location}' holds the state of a {kind} {name}, but a "
            f"{type_name(obj)} was given; build the {name} as it was when saved."
        )
    if adapt is not None:
        state = adapt(state)
    own = type_name(obj).startswith("phalanx.")
    problems = check_like(obj.state_dict(), state, f"the {name} state", keys=own)
    if problems:
        raise CheckpointError(
            f"{where}: the {name} state in '{location}' does not fit this {name}: "
            + "; ".join(problems)
            + f". Build the {name} as it was built when saved."
        )
    probe_load(where, location, name, obj, state)
    return state
