"""Checks that N modules share one architecture, collecting every difference."""

from __future__ import annotations

import enum
import functools
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from phalanx import _torch_compat as compat
from phalanx.backends._rates import has_member_p


def _fmt_shape(shape: Iterable[int]) -> str:
    dims = tuple(shape)
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def as_module_list(models: object, where: str) -> list[nn.Module]:
    """Turns the user's ``models`` argument into a non-empty list of modules.

    Raises:
        TypeError: ``models`` is not a sequence of ``nn.Module``.
        ValueError: ``models`` is empty.
    """
    if isinstance(models, nn.Module) and not isinstance(models, nn.ModuleList):
        raise TypeError(
            f"{where}: expected N modules (a list, tuple or nn.ModuleList), got a single "
            f"{type(models).__name__}. Pass a list, e.g. phalanx.stack([model_a, model_b])."
        )
    if not isinstance(models, (list, tuple, nn.ModuleList)):
        raise TypeError(
            f"{where}: expected a list, tuple or nn.ModuleList of modules, "
            f"got {type(models).__name__}."
        )
    members = list(models)
    if not members:
        raise ValueError(f"{where}: got no members; pass at least one nn.Module.")
    bad = [
        f"member {i} is a {type(m).__name__}"
        for i, m in enumerate(members)
        if not isinstance(m, nn.Module)
    ]
    if bad:
        raise TypeError(f"{where}: every member must be an nn.Module; " + "; ".join(bad) + ".")
    return members


def _tensor_table(module: nn.Module) -> dict[str, tuple[str, torch.Tensor | None]]:
    table: dict[str, tuple[str, torch.Tensor | None]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        table[name] = ("parameter", p)
    for name, b in module.named_buffers(remove_duplicate=False):
        table[name] = ("buffer", b)
    # Buffers registered as None (e.g. BatchNorm without running stats) are part of the
    # architecture too: a member that tracks statistics cannot be stacked with one that does not.
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for leaf, b in compat.own_buffers(sub).items():
            if b is None:
                table[f"{prefix}.{leaf}" if prefix else leaf] = ("buffer", None)
    return table


def architecture_differences(
    reference: nn.Module,
    other: nn.Module,
    index: int,
    *,
    ref_name: str = "member 0",
    check_device: bool = True,
    check_mode: bool = True,
) -> list[str]:
    """Lists every way ``other`` (member ``index``) differs from ``reference``."""
    diffs: list[str] = []
    setting_diffs: dict[str, str] = {}
    who = f"member {index}"

    ref_modules = dict(reference.named_modules(remove_duplicate=False))
    oth_modules = dict(other.named_modules(remove_duplicate=False))
    ref_types = {p: _kind(m) for p, m in ref_modules.items()}
    oth_types = {p: _kind(m) for p, m in oth_modules.items()}
    for path in ref_types.keys() | oth_types.keys():
        shown = repr(path) if path else "the root module"
        if path not in oth_types:
            diffs.append(
                f"{who} has no submodule {shown}, {ref_name} has a {ref_types[path].__name__}"
            )
        elif path not in ref_types:
            diffs.append(f"{who} has an extra submodule {shown} ({oth_types[path].__name__})")
        elif ref_types[path] is not oth_types[path]:
            diffs.append(
                f"{who} submodule {shown} is a {oth_types[path].__name__}, "
                f"{ref_name} has a {ref_types[path].__name__}"
            )
        else:
            # Settings that live outside tensors (BatchNorm's eps, a LeakyReLU's slope) would
            # silently be taken from member 0: their repr shows them. A Dropout's p is a
            # per-member value the stack keeps (backends/_rates.py), not a setting.
            ref_repr = settings_repr(ref_modules[path])
            oth_repr = settings_repr(oth_modules[path])
            if ref_repr != oth_repr:
                name = ref_types[path].__name__
                ref_repr = ref_modules[path].extra_repr()
                oth_repr = oth_modules[path].extra_repr()
                setting_diffs[path] = (
                    f"{who} submodule {shown} is {name}({oth_repr}), {ref_name} has "
                    f"{name}({ref_repr})"
                )

    ref_t = _tensor_table(reference)
    oth_t = _tensor_table(other)
    for name in sorted(ref_t.keys() | oth_t.keys()):
        if name not in oth_t:
            kind = ref_t[name][0]
            diffs.append(f"{who} has no {kind} '{name}', {ref_name} has one")
            continue
        if name not in ref_t:
            diffs.append(f"{who} has an extra {oth_t[name][0]} '{name}'")
            continue
        kind, a = ref_t[name]
        okind, b = oth_t[name]
        if kind != okind:
            diffs.append(f"{who} '{name}' is a {okind}, in {ref_name} a {kind}")
            continue
        if (a is None) != (b is None):
            diffs.append(
                f"{who} {kind} '{name}' is {'None' if b is None else 'a tensor'}, in {ref_name} "
                f"{'None' if a is None else 'a tensor'}"
            )
            continue
        if a is None or b is None:
            continue
        if a.shape != b.shape:
            setting_diffs.pop(name.rpartition(".")[0], None)  # the shapes say it already
            diffs.append(
                f"{who} {kind} '{name}' has shape {_fmt_shape(b.shape)}, "
                f"{ref_name} has {_fmt_shape(a.shape)}"
            )
        if a.dtype != b.dtype:
            diffs.append(f"{who} {kind} '{name}' has dtype {b.dtype}, {ref_name} has {a.dtype}")
        if check_device and a.device != b.device:
            diffs.append(
                f"{who} {kind} '{name}' is on {b.device}, {ref_name} on {a.device}; "
                f"move every member to one device first"
            )
        if kind == "parameter" and a.requires_grad != b.requires_grad:
            diffs.append(
                f"{who} parameter '{name}' has requires_grad={b.requires_grad}, "
                f"{ref_name} has requires_grad={a.requires_grad}"
            )

    diffs.extend(setting_diffs.values())
    for path, sub in oth_modules.items() if check_mode else ():
        ref_sub = ref_modules.get(path)
        if ref_sub is not None and ref_sub.training != sub.training:
            shown = f"submodule {path!r}" if path else "the root module"
            diffs.append(
                f"{who} {shown} is in {'train' if sub.training else 'eval'} mode, {ref_name} in "
                f"{'train' if ref_sub.training else 'eval'} mode; call .train() or .eval() on "
                f"every member first"
            )
            break
    return diffs


def settings_repr(module: nn.Module) -> str:
    """The module's settings as its repr shows them, less the per-member ones (a Dropout's
    ``p``, which members may differ in)."""
    if has_member_p(module):
        return f"inplace={module.inplace}"
    return module.extra_repr()


def _kind(module: nn.Module) -> type:
    """The module's class; for a parametrized module (a class made per instance), the original."""
    if parametrize.is_parametrized(module):
        return type(module).__bases__[0]
    return type(module)


# What every nn.Module keeps in its __dict__: not the member's own settings.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"training"}
_DEPTH = 6  # how deep objects held as attributes are compared
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)


def _same_value(a: Any, b: Any, registered: frozenset[int] = frozenset(), depth: int = 0) -> bool:
    """Whether two attribute values are the same setting, as far as one can tell.

    Tensors in ``registered`` (the members' own parameters and buffers, which LSTM keeps a
    list of) are the members' weights, not settings. Objects (a Hugging Face
    ``PretrainedConfig``, a dataclass of options) are compared by their own ``==`` where they
    define one, else attribute by attribute.
    """
    if depth > _DEPTH:
        return True
    if isinstance(a, weakref.ReferenceType) or isinstance(b, weakref.ReferenceType):
        return type(a) is type(b)
    if id(a) in registered and id(b) in registered:
        return True
    if isinstance(a, _PLAIN) or isinstance(b, _PLAIN):
        return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN equals NaN here
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same_value(x, y, registered, depth + 1) for x, y in zip(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(
            _same_value(a[k], b[k], registered, depth + 1) for k in a
        )
    if isinstance(a, nn.Module) or isinstance(b, nn.Module):
        return type(a) is type(b)  # submodules are compared on their own
    if callable(a) or callable(b):
        return _hook_identity(a) == _hook_identity(b)
    if type(a) is not type(b):
        return False
    if a is b or type(a).__module__.split(".")[0] in ("torch", "builtins"):
        return True  # torch's own objects (a ScriptModule's C++ half) are compared by type
    if type(a).__eq__ is not object.__eq__:
        try:
            return bool(a == b)
        except Exception:  # an __eq__ that cannot compare these: fall back to the attributes
            pass
    fields_a, fields_b = getattr(a, "__dict__", None), getattr(b, "__dict__", None)
    if isinstance(fields_a, dict) and isinstance(fields_b, dict):
        return _same_value(fields_a, fields_b, registered, depth + 1)
    return True


def _hook_identity(fn: Any) -> Any:
    """What makes two hooks (or callables) the same: their code and the plain values they hold."""
    if isinstance(fn, functools.partial):
        return ("partial", _hook_identity(fn.func), len(fn.args), tuple(sorted(fn.keywords)))
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is None:
        return (
            "object",
            func
            if isinstance(func, type) or (callable(func) and not hasattr(func, "__dict__"))
            else type(func),
        )
    cells = tuple(
        c.cell_contents if isinstance(c.cell_contents, _PLAIN) else type(c.cell_contents)
        for c in (func.__closure__ or ())
    )
    return ("code", code, cells)


def behaviour_differences(
    reference: nn.Module, other: nn.Module, index: int, *, ref_name: str = "member 0"
) -> list[str]:
    """What the member's forward can read besides tensors: plain attributes and hooks.

    Member 0's copy runs every member's forward, so a setting that differs would silently be
    taken from member 0.
    """
    diffs: list[str] = []
    who = f"member {index}"
    oth_modules = dict(other.named_modules(remove_duplicate=False))
    registered = frozenset(
        id(t) for m in (reference, other) for t in [*m.parameters(), *m.buffers()]
    )
    # (id of member 0's value, id of the member's) -> (its message's index, other holders)
    shared: dict[tuple[int, int], tuple[int, list[str]]] = {}
    for path, ref in reference.named_modules(remove_duplicate=False):
        oth = oth_modules.get(path)
        if oth is None or _kind(oth) is not _kind(ref):
            continue  # reported by architecture_differences
        where = f"submodule {path!r}" if path else "the root module"
        # A forward pre-hook may keep a tensor attribute it recomputes on every call (old-style
        # spectral_norm's 'weight'): that is derived from the member's tensors, not a setting.
        derived = (
            compat.module_hooks(ref)["_forward_pre_hooks"]
            and compat.module_hooks(oth)["_forward_pre_hooks"]
        )
        # Settings that extra_repr shows differ are reported by architecture_differences.
        keys = (
            set()
            if settings_repr(ref) != settings_repr(oth)
            else ref.__dict__.keys() | oth.__dict__.keys()
        )
        per_member = {"p"} if has_member_p(ref) else set()
        for key in sorted(keys - _MODULE_INTERNALS - per_member):
            a, b = ref.__dict__.get(key), oth.__dict__.get(key)
            pair = (id(a), id(b))
            if pair in shared:  # one config object held by every layer: reported once
                shared[pair][1].append(path)
                continue
            if derived and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                continue
            if key not in oth.__dict__ or key not in ref.__dict__:
                has, lacks = (ref_name, who) if key in ref.__dict__ else (who, ref_name)
                diffs.append(f"{where}: {has} has an attribute {key!r} that {lacks} lacks")
            elif not _same_value(a, b, registered):
                fields = _fields_that_differ(a, b, key, registered)
                if fields:  # an object of settings (a config): name the fields that differ
                    text = "; ".join(
                        f"{field}={_show(vb)} where {ref_name} has {_show(va)}"
                        for field, va, vb in fields[:_FIELDS_SHOWN]
                    )
                    if len(fields) > _FIELDS_SHOWN:
                        text += f" (and {len(fields) - _FIELDS_SHOWN} more fields)"
                    shared[pair] = (len(diffs), [])
                    diffs.append(f"{who} {where} has {text}")
                else:
                    diffs.append(
                        f"{who} {where} has {key}={_show(b)}, {ref_name} has {key}={_show(a)}"
                    )
        ref_hooks, oth_hooks = compat.module_hooks(ref), compat.module_hooks(oth)
        for hooks in compat.HOOK_DICTS:
            a = [_hook_identity(h) for h in ref_hooks[hooks].values()]
            b = [_hook_identity(h) for h in oth_hooks[hooks].values()]
            if a != b:
                kind = hooks.strip("_").replace("_", " ")[:-1]
                diffs.append(
                    f"{who} {where} has {len(b)} {kind}(s), {ref_name} has {len(a)}"
                    + (" that differ" if len(a) == len(b) else "")
                    + "; register the same hooks on every member"
                )
    for at, others in shared.values():
        if others:
            diffs[at] += (
                f" (the same object, held by {len(others)} more submodules, {others[0]!r}, ...)"
            )
    return diffs


_FIELDS_SHOWN = 8


def _fields_that_differ(
    a: Any, b: Any, name: str, registered: frozenset[int], depth: int = 0
) -> list[tuple[str, Any, Any]]:
    """``(path, member 0's value, the member's)`` of each plain field that differs between two
    objects of settings (a Hugging Face config, a dataclass, a dict); empty for other values."""
    fa = a if isinstance(a, dict) else getattr(a, "__dict__", None)
    fb = b if isinstance(b, dict) else getattr(b, "__dict__", None)
    if (
        depth > _DEPTH
        or not isinstance(fa, dict)
        or not isinstance(fb, dict)
        or type(a) is not type(b)
        or isinstance(a, nn.Module)
    ):
        return []
    out: list[tuple[str, Any, Any]] = []
    missing = "<missing>"
    for key in sorted(fa.keys() | fb.keys(), key=str):
        va, vb = fa.get(key, missing), fb.get(key, missing)
        if _same_value(va, vb, registered):
            continue
        path = f"{name}.{key}" if not isinstance(a, dict) else f"{name}[{key!r}]"
        deeper = _fields_that_differ(va, vb, path, registered, depth + 1)
        out += deeper or [(path, va, vb)]
    return out


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def tie_differences(members: Sequence[nn.Module], labels: Sequence[int] | None = None) -> list[str]:
    """Tensors shared between members, and ties within a member unlike member 0's.

    ``labels`` are the members' indices in messages (default: their positions).
    """
    label = list(labels) if labels is not None else list(range(len(members)))
    diffs: list[str] = []
    owner: dict[int, tuple[int, str]] = {}
    patterns: list[set[frozenset[str]]] = []
    for i, m in enumerate(members):
        groups: dict[int, list[str]] = {}
        named = [
            *m.named_parameters(remove_duplicate=False),
            *m.named_buffers(remove_duplicate=False),
        ]
        for name, t in named:
            groups.setdefault(id(t), []).append(name)
            first = owner.setdefault(id(t), (i, name))
            if first[0] != i:
                diffs.append(
                    f"member {label[i]} '{name}' is the same tensor as member {label[first[0]]} "
                    f"'{first[1]}': "
                    f"members share it, and a stack would silently untie it; give each member "
                    f"its own copy (copy.deepcopy(model))"
                )
        patterns.append({frozenset(g) for g in groups.values() if len(g) > 1})
    for i, pattern in enumerate(patterns[1:], start=1):
        if pattern != patterns[0]:

            def fmt(p: set[frozenset[str]]) -> str:
                return "; ".join(" = ".join(sorted(g)) for g in sorted(p, key=sorted)) or "none"

            diffs.append(
                f"member {label[i]} ties {fmt(pattern)}, member {label[0]} ties "
                f"{fmt(patterns[0])}; every member must tie the same tensors"
            )
    return diffs


def check_same_architecture(members: Sequence[nn.Module], where: str) -> None:
    """Raises once, listing every difference of members 1..N-1 against member 0.

    Raises:
        ValueError: some member differs from member 0.
    """
    diffs: list[str] = []
    for i, m in enumerate(members[1:], start=1):
        diffs.extend(architecture_differences(members[0], m, i))
        diffs.extend(behaviour_differences(members[0], m, i))
    diffs.extend(tie_differences(members))
    if diffs:
        raise ValueError(
            f"{where}: the members do not share one architecture:\n  - "
            + "\n  - ".join(diffs)
            + "\nAll members must share one architecture: the same module types, parameter and "
            "buffer names, shapes, dtypes, devices, train/eval mode, settings, hooks and ties; "
            "only tensor values may differ."
            + (
                " Members that differ only in the widths of Linear, Conv, BatchNorm or "
                "Embedding layers stack padded to the widest: phalanx.stack(models, "
                "pad_widths=True)."
                if all("has shape" in d for d in diffs)
                else ""
            )
        )


def check_materialised(members: Sequence[nn.Module], where: str, first_index: int = 0) -> None:
    """Refuses a member whose lazy module (``nn.LazyLinear``, ``LazyConv2d``) has not run yet:
    its parameters have no shape to stack."""
    for i, m in enumerate(members, start=first_index):
        lazy = [
            name
            for name, t in [*m.named_parameters(), *m.named_buffers()]
            if torch.nn.parameter.is_lazy(t)
        ]
        if lazy:
            raise ValueError(
                f"{where}: member {i}'s {lazy[0]!r} is not initialised yet (a lazy module such "
                f"as nn.LazyLinear takes its shape from its first input), so it has no shape to "
                f"stack. Run one forward on each member first, e.g. "
                f"`for m in models: m(x[:1])`, then stack them."
            )
