"""``phalanx.stack``: a :class:`Stack` from N modules, or from a factory one member at a time.

Stacking N ready-made members holds every weight twice: the members, then the stack
(256 members of a 1024-1024-1024 MLP: 2.28 GiB of members, 4.30 GiB at the peak of
``phalanx.stack``). Built here, the stacked tensors are allocated once, member i is built
under its own seed, copied into row i and dropped: the peak is the stack plus one member.

Why not build on ``meta`` and initialise afterwards: ``nn.Module.to_empty`` gives
uninitialised memory, and ``reset_parameters`` run on the *stacked* module computes
fan-in from the stacked shape ``(N, out, in)`` as ``out * in`` instead of ``in``, so a
1024-1024 Linear gets std 1/(1024 sqrt(3)) = 0.00056 instead of 1/(32 sqrt(3)) = 0.018:
a silently wrong init. Here every member runs its own constructor at its own shapes, so its
weights are bit for bit those of ``torch.manual_seed(seed + i); factory(i)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from phalanx._module_tree import meta_copy
from phalanx.backends._random import copy_generators, generator_slots
from phalanx.backends._rates import check_rate, has_member_p
from phalanx.core._stack import Stack
from phalanx.core._validate import (
    architecture_differences,
    behaviour_differences,
    check_materialised,
    tie_differences,
)

__all__ = ["build_members", "call_factory", "stack_from_factory"]

Factory = Callable[..., nn.Module]


def call_factory(factory: Factory, i: int) -> nn.Module:
    """Calls a factory of the member index, or of nothing."""
    try:
        takes_index = bool(inspect.signature(factory).parameters)
    except (TypeError, ValueError):  # builtins without a signature: try the index
        takes_index = True
    return factory(i) if takes_index else factory()


def _cuda_devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_initialized() else []


def _build_one(factory: Factory, i: int, seed: int | None, where: str) -> nn.Module:
    """Member i, built right after ``torch.manual_seed(seed + i)``; the caller's RNG is kept."""
    if seed is None:
        member = call_factory(factory, i)
    else:
        with torch.random.fork_rng(devices=_cuda_devices()):
            torch.manual_seed(seed + i)
            member = call_factory(factory, i)
    if not isinstance(member, nn.Module):
        raise TypeError(
            f"{where}: the factory returned a {type(member).__name__} for member {i}; it must "
            f"return one nn.Module, a new one on each call."
        )
    check_materialised([member], where, first_index=i)
    on_meta = [n for n, t in (*member.named_parameters(), *member.named_buffers()) if t.is_meta]
    if on_meta:
        raise ValueError(
            f"{where}: member {i} holds '{on_meta[0]}' on the meta device, which has no "
            f"values. Build members with real tensors: they are built one at a time and "
            f"copied into the stack, so memory stays at the stack plus one member. (Building on "
            f"meta, then to_empty() and reset_parameters() on the stacked module, initialises "
            f"from the stacked shapes: a silently wrong init.)"
        )
    return member


def build_members(
    factory: Factory,
    indices: range,
    *,
    seed: int | None,
    backend: str,
    device: torch.device | str | None,
    where: str,
) -> Stack:
    """A stack of the members ``indices`` (global indices; row j holds ``indices[j]``)."""
    if isinstance(factory, nn.Module) or not callable(factory):
        raise TypeError(
            f"{where}: expected a factory that builds one member (e.g. lambda i: MLP()); got "
            f"a {type(factory).__name__}. To stack modules you already have, pass a list of them."
        )
    first = _build_one(factory, indices[0], seed, where)
    reference = meta_copy(first)
    target = None if device is None else torch.device(device)
    with torch.no_grad():
        params = {
            name: torch.empty((len(indices), *p.shape), dtype=p.dtype, device=target or p.device)
            for name, p in first.named_parameters()
        }
        buffers = {
            name: torch.empty((len(indices), *b.shape), dtype=b.dtype, device=target or b.device)
            for name, b in first.named_buffers()
        }
    diffs: list[str] = []
    slots = generator_slots(first)
    generators: list[list[torch.Generator]] = []
    memo: dict[int, Any] = {}  # a generator the factory gives several members stays one
    rate_rows: list[dict[str, float]] = []  # each member's dropout rates (backends/_rates.py)
    member: nn.Module | None = first
    del first  # row 0 is copied below, then member 0 is dropped like the others
    for row, i in enumerate(indices):
        if member is None:
            member = _build_one(factory, i, seed, where)
            ref_name = f"member {indices[0]}"
            found = [
                *architecture_differences(
                    reference, member, i, ref_name=ref_name, check_device=False
                ),
                *behaviour_differences(reference, member, i, ref_name=ref_name),
                *tie_differences([reference, member], labels=[indices[0], i]),
            ]
            if found:
                diffs.extend(found)
                member = None
                continue
        with torch.no_grad():
            for name, t in params.items():
                t[row].copy_(member.get_parameter(name))
            for name, t in buffers.items():
                t[row].copy_(member.get_buffer(name))
        if slots:  # member i draws from its own generators (backends/_random.py)
            generators += copy_generators([member], slots, where, memo, first_index=i)
        rate_rows.append(
            {
                path: check_rate(member.get_submodule(path).p, where, f"member {i} {path!r}")
                for path, sub in reference.named_modules(remove_duplicate=False)
                if has_member_p(sub)
            }
        )
        member = None  # drop it before building the next: one member alive at a time
    if diffs:
        raise ValueError(
            f"{where}: the factory built members of different architectures; member "
            f"{indices[0]} is the reference:\n  - "
            + "\n  - ".join(diffs)
            + "\nThe factory must build one architecture for every index (the same module "
            "types, parameter and buffer names, shapes, dtypes and train/eval mode)."
        )
    rates = {
        path: torch.tensor([row[path] for row in rate_rows], dtype=torch.float64)
        for path in (rate_rows[0] if rate_rows else {})
        if any(row[path] != rate_rows[0][path] for row in rate_rows)
    }
    return Stack.from_stacked(
        reference,
        params,
        buffers,
        len(indices),
        backend=backend,
        generators=generators or None,
        dropout_rates=rates,
    )


def stack_from_factory(
    factory: Factory,
    *,
    num_members: int,
    seed: int | None = 0,
    backend: str = "auto",
    device: torch.device | str | None = None,
) -> Stack:
    """Builds N members from a factory straight into one :class:`Stack`, one at a time.

    The stacked tensors ``(N, *shape)`` are allocated once; member i is built, copied into
    row i and dropped before member i + 1 is built, so memory peaks at the stack plus one
    member, where building a list of N members and stacking it holds every weight twice.
    Member i's initial weights and buffers are bit for bit those of
    ``torch.manual_seed(seed + i); factory(i)``.

    Args:
        factory: builds one member: called with the member index ``i`` if it takes an
            argument (``lambda i: MLP(width=widths[i])``), else with none (``MLP``). It
            must return a new module of the same architecture for every index, with real
            tensors (not on the ``meta`` device).
        num_members: N >= 1.
        seed: member i is built right after ``torch.manual_seed(seed + i)``; the caller's
            random state is left as it was. None leaves seeding to the factory.
        backend: "auto", "fused", "vmap" or "loop", as for :func:`phalanx.stack`.
        device: where the stacked tensors live (e.g. "cuda"); members may be built on the
            CPU and are copied there row by row. None: the device the factory builds on.

    Returns:
        The stack of N members.

    Raises:
        TypeError: ``factory`` is not callable (or is a module), or returns a non-module.
        ValueError: ``num_members`` is not a positive int, a member is on the meta device,
            or members differ in architecture from member 0 (every difference is listed).

    Example:
        >>> stack = phalanx.stack(lambda i: nn.Linear(4, 2), num_members=8, seed=0)
        >>> _ = torch.manual_seed(3)  # member 3 is built right after this seed
        >>> torch.equal(stack.module.weight[3], nn.Linear(4, 2).weight)
        True
    """
    where = "phalanx.stack()"
    if isinstance(num_members, bool) or not isinstance(num_members, int) or num_members < 1:
        raise ValueError(
            f"{where}: with a factory, num_members must be a positive int, the number of "
            f"members to build; got {num_members!r}."
        )
    return build_members(
        factory, range(num_members), seed=seed, backend=backend, device=device, where=where
    )


def stack(
    models: Sequence[nn.Module] | nn.ModuleList | Callable[..., nn.Module],
    *,
    backend: str = "auto",
    num_members: int | None = None,
    seed: int | None = 0,
    device: torch.device | str | None = None,
    pad_widths: bool = False,
) -> Stack:
    """Stacks N modules of one architecture into one :class:`Stack`.

    The members' parameters and buffers are copied into stacked tensors ``(N, *shape)``; the
    original modules are left untouched (use :meth:`Stack.copy_to` to write results back).

    Args:
        models: N >= 1 modules (a list, tuple or ``nn.ModuleList``) with the same module types,
            parameter and buffer names, shapes, dtypes, devices, train/eval mode, settings,
            hooks and ties; or a factory that builds one member (``lambda i: MLP()``), called
            N times, each member copied into the stack and dropped before the next is built,
            so that memory never holds two copies of the weights.
        backend: "auto" (the fastest backend that runs the architecture exactly, announced
            when it has to fall back), "fused", "vmap" or "loop" (member by member: the
            reference).
        num_members: with a factory, N.
        seed: with a factory, member i is built right after ``torch.manual_seed(seed + i)``,
            so its weights are those of ``torch.manual_seed(seed + i); factory(i)``; None
            leaves seeding to the factory.
        device: with a factory, where the stacked tensors live.
        pad_widths: members may differ in the widths of their Linear, Conv, BatchNorm and
            Embedding layers (not in their input and output widths): the stacked tensors are
            padded to the widest with zeros that stay zero (gradients masked), so each member
            computes what it computes alone; refused, naming the layer, wherever padding would
            change a result (a LayerNorm or softmax over a padded width, a reduction, an
            output width that differs). See docs/SEARCH.md. With a factory, all N members
            are built first.

    Returns:
        The stack, an ``nn.Module``.

    Raises:
        TypeError: ``models`` is not a sequence of modules.
        ValueError: no members, an unknown backend, or members that differ; every
            difference is listed at once.

    Example:
        >>> models = [nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)) for _ in range(8)]
        >>> stack = phalanx.stack(models)
        >>> stack(torch.randn(32, 10)).shape
        torch.Size([8, 32, 2])
        >>> sweep = [nn.Sequential(nn.Linear(10, w), nn.ReLU(), nn.Linear(w, 2)) for w in (8, 32)]
        >>> stack = phalanx.stack(sweep, pad_widths=True)
        >>> stack.module[0].weight.shape, stack.unstack()[0][0].weight.shape
        (torch.Size([2, 32, 10]), torch.Size([8, 10]))
    """
    if callable(models) and not isinstance(models, nn.Module) and pad_widths:
        if num_members is None:
            raise TypeError(
                "phalanx.stack(): a factory needs num_members=N, the number of members to "
                "build, e.g. phalanx.stack(lambda i: MLP(widths[i]), num_members=8)."
            )
        factory = cast("Factory", models)
        built = [_build_one(factory, i, seed, "phalanx.stack()") for i in range(num_members)]
        if device is not None:
            built = [m.to(device) for m in built]
        return Stack(built, backend=backend, pad_widths=True)
    if callable(models) and not isinstance(models, nn.Module):
        if num_members is None:
            raise TypeError(
                "phalanx.stack(): a factory needs num_members=N, the number of members to "
                "build, e.g. phalanx.stack(lambda i: MLP(), num_members=8)."
            )
        return stack_from_factory(
            models, num_members=num_members, seed=seed, backend=backend, device=device
        )
    models = cast("Sequence[nn.Module] | nn.ModuleList", models)
    if num_members is not None and num_members != len(models):
        raise ValueError(
            f"phalanx.stack(): num_members={num_members} but {len(models)} modules were given; "
            f"drop num_members when passing modules."
        )
    return Stack(models, backend=backend, pad_widths=pad_widths)
