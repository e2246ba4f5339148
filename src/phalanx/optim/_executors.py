"""The step executors: how a rule's update runs over whole stacked tensors.

``fast_update`` (the rule's kernel once over the stacked tensors, where the members share
every value and step count); ``fused_step`` (torch's fused kernel on the members' views, per
set of members that share every value); ``inplace_step`` (the rule's ``update_`` on
cache-sized blocks, in place, with masks); ``blocked_step`` (the rule's pure ``update`` on
blocks, written back: strided tensors). Plus the step counts the host keeps, and the views
and scratch buffers kept across steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from phalanx import _torch_compat as compat
from phalanx._warnings import FallbackWarning, warn

from ._arith import math_dtype, per_member

if TYPE_CHECKING:
    from ._base import MemberOptimizer

__all__ = ["Buffers", "blocked_step", "fused_step", "inplace_step"]


class Buffers:
    """What a step keeps across steps on the optimizer, outside its state: the members'
    views of stacked tensors, and scratch buffers (a mixin of ``MemberOptimizer``)."""

    def _kept_rows(self, t: Tensor) -> list[Tensor]:
        """The N members' views ``t[i]`` of a stacked tensor that persists across steps (a
        parameter, its optimizer state), for torch's fused kernels, which take one tensor per
        member; kept across steps instead of made anew (for a transformer of 15 stacked
        tensors and 8 members, 600 ``select`` calls a step).

        A view is made again whenever its tensor is another object or holds other memory
        (``.data`` assigned, ``.to()``, a state loaded, a resize), so it always views what the
        step must write; kept views of tensors no longer stepped are dropped at the end of the
        step. Never for gradients: they are new every step. Not in ``state_dict``, nor in a
        copy or pickle of the optimizer.
        """
        cache: dict[int, tuple[Tensor, tuple, list[Tensor]]]
        cache = self.__dict__.setdefault("_rows", {})
        self.__dict__.setdefault("_rows_used", set()).add(id(t))
        key = (compat.memory_stamp(t), torch.is_inference_mode_enabled())
        entry = cache.get(id(t))
        if entry is None or entry[0] is not t or entry[1] != key:
            entry = cache[id(t)] = (t, key, [t[i] for i in range(t.shape[0])])
        return entry[2]

    def _drop_unused_rows(self) -> None:
        """Forgets the kept views of tensors this step did not use (a replaced state's)."""
        used = self.__dict__.get("_rows_used")
        if used is None:
            return
        cache = self.__dict__["_rows"]
        if len(cache) != len(used):
            self.__dict__["_rows"] = {k: v for k, v in cache.items() if k in used}
        used.clear()

    def _scratch(self, p: Tensor, count: int, size: int) -> list[Tensor]:
        """``count`` buffers of ``size`` elements or more in ``p``'s dtype and device, kept
        across steps (never part of the state: a state_dict does not hold them)."""
        cache: dict[tuple[torch.device, torch.dtype], list[Tensor]]
        cache = self.__dict__.setdefault("_scratch_buffers", {})
        key = (p.device, p.dtype)
        kept = cache.setdefault(key, [])
        if kept and kept[0].numel() < size:
            kept.clear()  # a larger block: all anew
        while len(kept) < count:
            kept.append(
                torch.empty(
                    max(size, kept[0].numel() if kept else 0), dtype=p.dtype, device=p.device
                )
            )
        return kept[:count]


# parameter has the same count, and the host counts steps as it takes them, so the fast
# path knows it may run one kernel with one count, with no read of a device value.
# ``_counts``: id(param) -> (its count, id and ``_version`` of its "step" tensor when
# counted), so a write from elsewhere (the captured step, surgery, a load, the user) makes
# it unknown; False once a mask may have split the members; None (or absent: a copy, a
# pickle) when unknown: read once from the state (one host sync).


def shared_counts(opt: MemberOptimizer, params: list[Tensor]) -> list[int] | None:
    """The step count of each parameter before this step, where its members share it."""
    counts = opt.__dict__.get("_counts")
    if counts is False:
        return None
    if counts is None or not all(counted(opt, counts, p) for p in params):
        counts = opt.__dict__["_counts"] = read_counts(opt)
        if counts is False:
            return None
    return [counts[id(p)][0] for p in params]


def counted(opt: MemberOptimizer, counts: dict[int, tuple[int, int, int]], p: Tensor) -> bool:
    """Whether the host's count of ``p`` is its state's (nothing wrote it since)."""
    entry, step = counts.get(id(p)), opt.state[p].get("step")
    return entry is not None and entry[1:] == (
        id(step),
        compat.version(step) if step is not None else -1,
    )


def read_counts(opt: MemberOptimizer) -> dict[int, tuple[int, int, int]] | Literal[False]:
    """The counts read from the state (one host sync, once after a load or surgery)."""
    steps = {
        id(p): s["step"]
        for g in opt.param_groups
        for p in g["params"]
        if isinstance((s := opt.state.get(p, {})).get("step"), Tensor)
    }
    if not steps:
        return {}
    low_high = torch.stack(
        [torch.stack([s.min(), s.max()]).to(torch.float64) for s in steps.values()]
    ).tolist()
    if any(low != high for low, high in low_high):
        return False
    return {
        k: (int(low), id(s), compat.version(s))
        for (k, s), (low, _) in zip(steps.items(), low_high, strict=True)
    }


def count(opt: MemberOptimizer, params: list[Tensor], active: Tensor | None) -> None:
    """Counts a step of ``params`` on the host (forgets the counts after a masked step)."""
    counts = opt.__dict__.get("_counts")
    if active is not None:
        opt.__dict__["_counts"] = False
    elif isinstance(counts, dict):
        for p in params:
            step = opt.state[p]["step"]
            if id(p) in counts:
                counts[id(p)] = (counts[id(p)][0] + 1, id(step), compat.version(step))


def fast_applies(opt: MemberOptimizer, group: dict[str, Any], params: list[Tensor]) -> bool:
    """Whether ``fast_update`` can take this group now: the rule has it, every
    hyperparameter is one number for all members, and every tensor is contiguous on a
    device torch's fused kernels support, in one floating dtype per parameter."""
    if not opt.FAST or not opt.fast_takes(group):
        return False
    for key, value in group.items():
        if key == "member_lr":
            continue
        if isinstance(value, Tensor) or (
            isinstance(value, tuple) and any(isinstance(v, Tensor) for v in value)
        ):
            return False
    for p in params:
        if p.device.type not in ("cpu", "cuda") or not p.is_floating_point():
            return False
        if not dense_like(opt, p):
            return False
    return True


def dense_like(opt: MemberOptimizer, p: Tensor) -> bool:
    """Whether ``p``, its gradient and its state (but "step") are contiguous tensors of
    ``p``'s shape and dtype: what a kernel over whole stacked tensors reads."""
    state = [v for k, v in opt.state[p].items() if k != "step"]
    for t in [p.grad, *state]:
        if t is None or t.shape != p.shape or t.dtype != p.dtype:
            return False
    return all(t.is_contiguous() for t in [p, p.grad, *state])


def inplace_step(
    opt: MemberOptimizer,
    group: dict[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    active: Tensor | None,
) -> None:
    """``update_`` on blocks of each stacked tensor (``block_size``), in place: the rule's
    torch operations write into the parameter, its state and two scratch buffers reused
    across steps, so a step reads and writes each block while it is in cache and allocates
    nothing the size of a block. With a mask (a tensor: never read on the host), each
    block's parameter and state rows are kept in scratch first and put back for the
    masked members (``torch.where``), so their values and counts stay bit for bit. State the
    rule names but the parameter lacks (SGD's buffer, after a scheduler turned momentum on)
    starts now, as zeros, and the rule's ``values`` hears of it. A parameter that cannot be
    viewed as (N, M) (a strided one) takes ``blocked_step``."""
    device = params[0].device
    h = opt.update_hyperparameters(group, device)
    options = opt.options(group)
    rule = type(opt)
    names = rule.state_names(**options)
    block = opt.block_size(device)
    rest: tuple[list[Tensor], list[Tensor]] = ([], [])
    for p, g in zip(params, grads, strict=True):
        state = opt.state[p]
        flat = _flat_views(p, g, state)
        if flat is None:
            rest[0].append(p)
            rest[1].append(g)
            continue
        started = frozenset(k for k in names if k not in state)
        for k in started:
            state[k] = torch.zeros_like(p)
            flat[k] = state[k].view(flat["param"].shape)
        step = state["step"].to(math_dtype(p.device)) + 1  # no copy unless float32 counts
        values = rule.values(h, step, started, **options)
        # (N, 1) in p's dtype, cast once for the parameter (as the pure rule's per_member)
        whole = {
            k: per_member(x, flat["param"]) if isinstance(x, Tensor) else x
            for k, x in values.items()
        }
        n, m = flat["param"].shape
        size = max(1, n * m) if block is None else block
        kept = [k for k in flat if k != "grad"]  # what a masked member keeps
        a, b, *saved = opt._scratch(p, 2 + (len(kept) if active is not None else 0), size)
        keep = None if active is None else active.to(p.device).view(-1, 1)
        cut: tuple[int, int] | None = None
        v: dict[str, Any] = {}
        for r0, r1, c0, c1 in _inplace_blocks(n, m, size):
            if cut != (r0, r1):  # one block's members' values, reused by the next block
                cut = (r0, r1)
                v = {k: x[r0:r1] if isinstance(x, Tensor) else x for k, x in whole.items()}
            shape = (r1 - r0, c1 - c0)
            numel = shape[0] * shape[1]
            views = {k: t[r0:r1, c0:c1] for k, t in flat.items()}
            backup = [buf[:numel].view(shape) for buf in saved]
            for k, buf in zip(kept, backup, strict=False):
                buf.copy_(views[k])
            scratch = (a[:numel].view(shape), b[:numel].view(shape))
            pv, gv = views.pop("param"), views.pop("grad")
            rule.update_(pv, gv, views, v, scratch, **options)
            if keep is not None:
                views["param"] = pv
                for k, buf in zip(kept, backup, strict=True):
                    torch.where(keep[r0:r1], views[k], buf, out=views[k])
        if active is None:
            state["step"].copy_(step)
        else:
            state["step"].add_(active.to(p.device))  # + 1 for the members that stepped
    if rest[0]:
        blocked_step(opt, group, rest[0], rest[1], active)


def blocked_step(
    opt: MemberOptimizer,
    group: dict[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    active: Tensor | None,
) -> None:
    """The rule's pure ``update`` on blocks of ``BLOCK`` elements of each stacked tensor,
    written back in place (for tensors ``inplace_step`` cannot view as (N, M), and as its
    reference in the tests): no temporary larger than a block, and a masked member's block keeps its old
    values (``torch.where`` into the state), so nothing the size of the stack is cloned."""
    device = params[0].device
    h = opt.update_hyperparameters(group, device)
    options = opt.options(group)
    rule = type(opt).update
    for p, g in zip(params, grads, strict=True):
        state = opt.state[p]
        step = state["step"].to(math_dtype(p.device)) + 1  # no copy unless fused's float32
        keep = None if active is None else active.to(p.device)
        started: dict[str, Tensor] = {}  # state entries the rule starts now (SGD's buffer)
        block = opt.block_size(p.device)
        for rows, flat, blocks in _blocks(p, g, state, block or max(1, p.numel())):
            part = {k: v[blocks] for k, v in flat.items() if k not in ("param", "grad")}
            part["step"] = step[rows]
            hb = {k: v[rows] if isinstance(v, Tensor) else v for k, v in h.items()}
            new = rule(flat["param"][blocks], flat["grad"][blocks], part, hb, **options)
            for key, value in new.items():
                if key not in flat and key not in started:
                    state[key] = torch.zeros_like(p)
                    whole = flat["param"] is p
                    started[key] = state[key] if whole else state[key].view(p.shape[0], -1)
                target = (flat[key] if key in flat else started[key])[blocks]
                if keep is None:
                    target.copy_(value)
                else:
                    m = keep[rows].view(-1, *([1] * (target.dim() - 1)))
                    torch.where(m, value, target, out=target)
        if keep is None:
            state["step"].copy_(step)
        else:
            state["step"].add_(keep)  # + 1 for the members that stepped


def fused_applies(opt: MemberOptimizer, params: list[Tensor], grads: list[Tensor]) -> bool:
    """Whether torch's fused kernel can run on the members' views: each must be
    contiguous (a member's view of a contiguous stacked tensor is). Otherwise the step
    runs the exact single-tensor path, and says so once."""
    tensors = [*params, *grads]
    tensors += [t for p in params for t in opt.state[p].values() if t.dim() > 1]
    if all(t.is_contiguous() for t in tensors):
        return True
    if not getattr(opt, "_warned_fused", False):
        opt.__dict__["_warned_fused"] = True
        warn(
            f"{opt._NAME}(fused=True): a parameter, gradient or state tensor is not "
            "contiguous, so torch's fused kernel cannot run on the members' views; this "
            "step runs the default (single-tensor) arithmetic, whose bits are those of "
            "torch.optim without fused=True.",
            FallbackWarning,
        )
    return False


def fused_step(
    opt: MemberOptimizer,
    group: dict[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    active: Tensor | None,
) -> None:
    """torch's fused kernel once per set of members that share every hyperparameter
    value, on the members' views ``p[i]``: each view is its own tensor to the kernel (its
    own vector body and tail), so member i gets the bits of ``torch.optim`` with
    ``fused=True`` on member i alone, whatever N, and a masked member is left out."""
    device = params[0].device
    n = opt.num_members
    columns = member_columns(opt, group, device)
    flags = [True] * n if active is None else active.tolist()  # fused=True's mask: 1 sync
    steps = [opt.state[p]["step"] for p in params]
    if active is None:
        compat.foreach_add_(steps, 1)
    else:
        increment = active.to(device=steps[0].device, dtype=steps[0].dtype)
        compat.foreach_add_(steps, [increment] * len(steps))
    sets: dict[tuple, list[int]] = {}
    for i in range(n):
        if flags[i]:
            sets.setdefault(tuple(column[i] for column in columns.values()), []).append(i)
    for key, members in sets.items():
        opt.fused_update(group, members, params, grads, dict(zip(columns, key)))


def member_columns(
    opt: MemberOptimizer, group: dict[str, Any], device: torch.device
) -> dict[str, list]:
    """Each member's hyperparameter values as Python numbers (``update_hyperparameters``'
    names), read from the device once and kept until an entry of the group changes (a
    scheduler's write, a tensor written in place): a steady step reads nothing."""
    stamp = tuple(
        (k, id(v), compat.version(v) if isinstance(v, Tensor) else v)
        for k, v in group.items()
        if k != "params"
    )
    kept = opt.__dict__.setdefault("_columns", {})
    entry = kept.get(id(group))
    if entry is None or entry[0] != stamp:
        n = opt.num_members
        h = opt.update_hyperparameters(group, device)
        columns = {k: v.tolist() if isinstance(v, Tensor) else [v] * n for k, v in h.items()}
        entry = kept[id(group)] = (stamp, columns)
    return entry[1]


def _flat_view(t: Tensor, p: Tensor) -> Tensor | None:
    """``t`` as (N, M) without a copy, when it is shaped like ``p``; else None."""
    if t.shape != p.shape or p.dim() < 1:
        return None
    try:
        return t.view(p.shape[0], -1)
    except RuntimeError:  # not viewable (strided): the rule runs on the whole tensor
        return None


def _blocks(
    p: Tensor, g: Tensor, state: dict[str, Any], size: int
) -> Iterator[tuple[slice, dict[str, Tensor], tuple[slice, ...]]]:
    """The blocks of ``update``: (member rows, the tensors by name as (N, M) views, the
    block's index into them), ``size`` elements or so each, rows of members first."""
    tensors = {"param": p, "grad": g, **{k: v for k, v in state.items() if k != "step"}}
    flat = {k: _flat_view(v, p) for k, v in tensors.items()}
    n = p.shape[0] if p.dim() else 1
    if any(v is None for v in flat.values()) or p.numel() <= size:
        yield slice(0, n), tensors, (slice(None),)  # one block: the tensors as they are
        return
    views: dict[str, Tensor] = flat  # type: ignore[assignment]
    m = p.numel() // n
    if m >= size:
        for i in range(n):
            for c in range(0, m, size):
                yield slice(i, i + 1), views, (slice(i, i + 1), slice(c, c + size))
    else:
        per = max(1, size // m)
        for r in range(0, n, per):
            yield slice(r, r + per), views, (slice(r, r + per), slice(None))


def _flat_views(p: Tensor, g: Tensor, state: dict[str, Any]) -> dict[str, Tensor] | None:
    """``p``, ``g`` and ``p``'s state tensors as (N, M) views (no copy), or None when one of
    them cannot be viewed so (a strided tensor) or ``p`` has no member axis."""
    tensors = {"param": p, "grad": g, **{k: v for k, v in state.items() if k != "step"}}
    flat = {k: _flat_view(v, p) for k, v in tensors.items()}
    if any(v is None or not v.is_contiguous() for v in flat.values()):
        return None
    return flat  # type: ignore[return-value]


def _inplace_blocks(n: int, m: int, size: int) -> Iterator[tuple[int, int, int, int]]:
    """(row start, row stop, column start, column stop) of the blocks of an (n, m) tensor,
    ``size`` elements or fewer each: a row longer than ``size`` in column chunks, shorter rows
    several to a block (all of them when ``size`` is the tensor's)."""
    if m >= size and n > 1:
        for i in range(n):
            for c in range(0, m, size):
                yield i, i + 1, c, min(c + size, m)
    elif m >= size:
        for c in range(0, m, size):
            yield 0, 1, c, min(c + size, m)
    else:
        per = max(1, size // max(m, 1))
        for r in range(0, n, per):
            yield r, min(r + per, n), 0, m
