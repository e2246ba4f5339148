"""``phalanx.polyak_``: a Polyak (EMA) update between two stacks, or two modules, in one call."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx import _torch_compat as compat
from phalanx.core._stack import Stack
from phalanx.core._widths import member_shapes, width_differences

_BUFFERS = ("average", "copy", "keep")


def polyak_(
    target: nn.Module, source: nn.Module, tau: Any, *, buffers: str = "average"
) -> nn.Module:
    """Moves ``target`` towards ``source``: ``t <- t + tau * (s - t)``, in place.

    The soft target update of DQN/SAC/TD3 (``tau=0.005``) and an exponential moving average
    of weights (``tau = 1 - decay``), for all members at once: one ``torch._foreach_lerp_``
    over the stacked tensors under ``torch.no_grad``, so member i gets exactly what
    ``torch._foreach_lerp_`` (``torch.lerp``) gives on member i's own modules, bit for bit.

    Args:
        target: the stack (or module) updated in place, e.g. the target critics.
        source: a stack (or module) of the same architecture: the same parameter and buffer
            names, shapes, dtypes and devices (``copy.deepcopy(stack)`` is one).
        tau: the step, a number in [0, 1]; or, when both are stacks, one per member (an
            ``(N,)`` tensor, list or array): member i moves by ``tau[i]``.
        buffers: what happens to the buffers (BatchNorm running statistics, counters):
            ``"average"`` (default) moves floating-point buffers like the parameters and
            copies the others (``num_batches_tracked``); ``"copy"`` copies every buffer from
            ``source``; ``"keep"`` leaves them.

    Returns:
        ``target``.

    Example:
        >>> import copy
        >>> critics = phalanx.stack([nn.Linear(4, 1) for _ in range(3)])
        >>> target = copy.deepcopy(critics).requires_grad_(False)
        >>> with torch.no_grad():
        ...     _ = critics.module.weight.add_(1.0)  # a critic update
        >>> _ = phalanx.polyak_(target, critics, 0.005)  # after every critic update
        >>> torch.allclose(target.module.weight, critics.module.weight - 0.995)
        True
    """
    where = "phalanx.polyak_()"
    if not isinstance(target, nn.Module) or not isinstance(source, nn.Module):
        raise TypeError(f"{where}: target and source must be stacks or modules.")
    if buffers not in _BUFFERS:
        raise ValueError(
            f"{where}: buffers must be one of {', '.join(map(repr, _BUFFERS))}; got {buffers!r}."
        )
    if isinstance(target, Stack) and isinstance(source, Stack):
        found = width_differences(member_shapes(target.padding), member_shapes(source.padding),
                                  ("target", "source"))  # fmt: skip
        if found:
            raise ValueError(
                f"{where}: target and source must have members of the same widths (padded "
                f"entries stay 0 only between equal widths):\n  - " + "\n  - ".join(found)
            )
    t_params, s_params = _pairs(where, "parameter", target.named_parameters(),
                                source.named_parameters())  # fmt: skip
    t_bufs, s_bufs = _pairs(where, "buffer", target.named_buffers(), source.named_buffers())
    members = target.num_members if isinstance(target, Stack) else None
    weights = _tau(where, tau, members, isinstance(source, Stack))
    with torch.no_grad():
        _lerp(t_params, s_params, weights)
        if buffers == "copy":
            for t, s in zip(t_bufs, s_bufs):
                t.copy_(s)
        elif buffers == "average":
            floating = [(t, s) for t, s in zip(t_bufs, s_bufs) if t.is_floating_point()]
            other = [(t, s) for t, s in zip(t_bufs, s_bufs) if not t.is_floating_point()]
            if floating:
                _lerp([t for t, _ in floating], [s for _, s in floating], weights)
            for t, s in other:
                t.copy_(s)
    return target


def _pairs(where: str, kind: str, target: Any, source: Any) -> tuple[list, list]:
    t, s = dict(target), dict(source)
    problems = []
    if t.keys() != s.keys():
        missing = sorted(set(t) ^ set(s))
        problems.append(f"{kind}s {missing} are in one of them only")
    for name in t.keys() & s.keys():
        a, b = t[name], s[name]
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            problems.append(
                f"{kind} {name!r}: {tuple(a.shape)} {a.dtype} {a.device} in target, "
                f"{tuple(b.shape)} {b.dtype} {b.device} in source"
            )
    if problems:
        raise ValueError(
            f"{where}: target and source must have the same architecture:\n  - "
            + "\n  - ".join(problems)
        )
    names = list(t)
    return [t[n] for n in names], [s[n] for n in names]


def _tau(where: str, tau: Any, members: int | None, source_stacked: bool) -> Any:
    """A number, or an ``(N,)`` float64 tensor of per-member steps."""
    if isinstance(tau, (int, float)) and not isinstance(tau, bool):
        if not 0.0 <= tau <= 1.0:
            raise ValueError(f"{where}: tau must be in [0, 1]; got {tau}.")
        return float(tau)
    if members is None or not source_stacked:
        raise TypeError(
            f"{where}: tau must be a number; one tau per member needs two stacks; got "
            f"{type(tau).__name__}."
        )
    values = torch.as_tensor(tau, dtype=torch.float64).detach().cpu()
    if values.shape != (members,):
        raise ValueError(
            f"{where}: a per-member tau must have shape ({members},), one per member; got "
            f"{tuple(values.shape)}."
        )
    if bool(((values < 0) | (values > 1)).any()):
        raise ValueError(f"{where}: every tau must be in [0, 1]; got {values.tolist()}.")
    return values


def _lerp(targets: list[torch.Tensor], sources: list[torch.Tensor], tau: Any) -> None:
    if not targets:
        return
    if isinstance(tau, float):
        compat.foreach_lerp_(targets, sources, tau)
        return
    values = tau.tolist()
    if all(v == values[0] for v in values):
        compat.foreach_lerp_(targets, sources, values[0])
        return
    # Member i's rows with member i's own tau as a Python number: the kernel torch runs on
    # the member alone (a tensor weight is another kernel, rounding differently).
    for i, value in enumerate(values):
        compat.foreach_lerp_([t[i] for t in targets], [s[i] for s in sources], value)
