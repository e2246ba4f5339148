"""Checks that N modules share one architecture, collecting every difference."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


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
        for leaf, b in sub._buffers.items():
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
    ref_types = {p: type(m) for p, m in ref_modules.items()}
    oth_types = {p: type(m) for p, m in oth_modules.items()}
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
            # Settings that live outside tensors (Dropout's p, BatchNorm's eps, a LeakyReLU's
            # slope) would silently be taken from member 0: their repr shows them.
            ref_repr = ref_modules[path].extra_repr()
            oth_repr = oth_modules[path].extra_repr()
            if ref_repr != oth_repr:
                name = ref_types[path].__name__
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


def check_same_architecture(members: Sequence[nn.Module], where: str) -> None:
    """Raises once, listing every difference of members 1..N-1 against member 0.

    Raises:
        ValueError: some member differs from member 0.
    """
    diffs: list[str] = []
    for i, m in enumerate(members[1:], start=1):
        diffs.extend(architecture_differences(members[0], m, i))
    if diffs:
        raise ValueError(
            f"{where}: the members do not share one architecture:\n  - "
            + "\n  - ".join(diffs)
            + "\nAll members must share one architecture: the same module types, parameter and "
            "buffer names, shapes, dtypes, devices and train/eval mode."
        )
