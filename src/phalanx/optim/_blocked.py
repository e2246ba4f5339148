"""The default mode's paths for groups torch's fused kernel cannot take in one call.

``mode="fast"`` promises each member the float rounding of its float64 update. Where members
share every hyperparameter and their step counts, the rule's ``fast_update`` calls torch's
fused kernel once on the whole stacked tensors. This module holds the two paths for the rest:

- ``member_views``: torch's fused kernel on the members' views ``p[i]`` (the ``fused=True``
  step), once per set of members sharing every value, where the members are large enough that
  a view's fixed cost (a few microseconds in the kernel's tensor list) is small against its
  arithmetic. Takes any per-member hyperparameter, masks and per-member step counts; each
  member's bits are ``torch.optim``'s ``fused=True`` on that member alone, whatever N.
- ``scaled_step``: per-member learning rates on members of any size. The step is linear in
  the rate once the rule's state is updated, so torch's fused kernel runs with rate 1 into a
  zeroed scratch block (it writes the negated step there and the state in place) and each
  member's rate scales the block into the parameter while it is in cache: one call of the
  kernel per block, two more passes over the block, no temporary the size of the stack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from phalanx import _torch_compat as compat

from ._executors import _inplace_blocks

if TYPE_CHECKING:
    from ._base import MemberOptimizer

__all__ = ["VIEW_ELEMENTS", "member_views", "scaled_step"]

VIEW_ELEMENTS = 1 << 15
"""Elements per member view, on average over a group's parameters, from which the default
mode runs torch's fused kernel on the members' views when one call on the stacked tensors
cannot take the group. A view costs ~2.4 us in the kernel's tensor list (CPU, 1 thread: tiny
8-64-64-1 members, ``fused=True`` against one call on the stacked tensors, 4096 members),
against ~0.8 ns an element of Adam's arithmetic: at 2**15 elements a view adds under 10%."""


def member_views(opt: MemberOptimizer, group: dict[str, Any], params: list[Tensor]) -> bool:
    """Whether the default mode's step of ``group`` is torch's fused kernel on the members'
    views (``MemberOptimizer._fused_step``): the rule has the kernel, the tensors are on a CPU
    (reading the members' values and the mask on the host is free there; on CUDA it would be
    a host sync a step), contiguous, floating, and the members large (``VIEW_ELEMENTS``)."""
    if not opt.FAST or not getattr(type(opt), "VIEWS", True):
        return False
    n = max(opt.num_members, 1)
    if sum(p.numel() for p in params) < VIEW_ELEMENTS * n * len(params):
        return False
    for p in params:
        if p.device.type != "cpu" or not p.is_floating_point():
            return False
        state = [v for k, v in opt.state[p].items() if k != "step"]
        for t in [p.grad, *state]:
            if t is None or t.shape != p.shape or t.dtype != p.dtype or not t.is_contiguous():
                return False
        if not p.is_contiguous():
            return False
    return True


#: ``run(ts, counts)``: torch's fused kernel with rate 1 and no weight decay on blocks:
#: ``ts`` maps "param" (zeroed scratch blocks), "grad" and the state's names to lists of
#: tensors, ``counts`` their parameters' shared step counts (0-d, for Adam), one per tensor.
Kernel = Callable[[dict[str, list[Tensor]], list[Tensor]], None]


def scaled_step(
    opt: MemberOptimizer,
    group: dict[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    keys: list[str],
    run: Kernel | None,
    *,
    coupled: float = 0.0,
    decoupled: float = 0.0,
    maximize: bool = False,
) -> None:
    """Per-member learning rates on torch's fused kernel: for each block of each stacked
    tensor, the kernel with rate 1 writes the negated step into a zeroed scratch block, then
    ``param += rate * scratch`` with each member's rate.

    Args:
        opt: the optimizer; ``opt.state[p]`` holds ``keys`` shaped like ``p``, and "step".
        group: the param group (its rates: ``opt.member_rates``).
        params, grads: the group's stacked parameters with a gradient, and those gradients.
        keys: the state tensors the kernel updates in place.
        run: the kernel, or None for a rule whose step is the gradient itself (SGD without
            momentum): then ``param -= rate * grad``.
        coupled: weight decay added to the gradient (``grad + coupled * param``, torch's
            Adam and SGD), done on the block before the kernel, which sees the scratch block
            and not the parameter.
        decoupled: AdamW's decay, ``param *= 1 - rate * decoupled`` before the step, as torch.
        maximize: step against the negated gradient (done with ``coupled``: the kernel then
            runs with ``maximize=False``).
    """
    rates = opt.member_rates(group, params[0].device)
    block = opt.block_size(params[0].device)
    prepass = coupled != 0 or maximize
    total = sum(p.numel() for p in params)
    together = run is not None and not prepass and (block is None or total <= block)
    if together and len({p.dtype for p in params}) == 1:  # one call: Python per call
        assert run is not None
        _scaled_together(opt, params, grads, keys, run, rates, decoupled, total)
        return
    for p, g in zip(params, grads, strict=True):
        state = opt.state[p]
        n = p.shape[0]
        m = p.numel() // max(n, 1)
        if n * m == 0:
            continue
        rate = rates[p.dtype].view(-1, 1)
        flat = {"param": p.view(n, m), "grad": g.reshape(n, m)}
        flat.update({k: state[k].view(n, m) for k in keys})
        size = n * m if block is None else min(block, n * m)
        scratch = opt._scratch(p, 1 + prepass, size)
        if decoupled != 0:
            flat["param"].mul_(1 - rate * decoupled)
        count = state["step"][0]  # every member's count (they share it): no host read
        for r0, r1, c0, c1 in _inplace_blocks(n, m, size):
            shape = (r1 - r0, c1 - c0)
            numel = shape[0] * shape[1]
            target = flat["param"][r0:r1, c0:c1]
            grad = flat["grad"][r0:r1, c0:c1]
            if prepass:  # the gradient the rule steps against, into scratch
                signed = scratch[1][:numel].view(shape)
                if maximize:
                    torch.neg(grad, out=signed)
                    grad = signed.add_(target, alpha=coupled) if coupled != 0 else signed
                else:
                    grad = torch.add(grad, target, alpha=coupled, out=signed)
            if run is None:
                target.addcmul_(grad, rate[r0:r1], value=-1)
                continue
            direction = scratch[0][:numel].view(shape).zero_()
            views = {k: [flat[k][r0:r1, c0:c1]] for k in keys}
            run({"param": [direction], "grad": [grad], **views}, [count])
            target.addcmul_(direction, rate[r0:r1])


def _scaled_together(
    opt: MemberOptimizer,
    params: list[Tensor],
    grads: list[Tensor],
    keys: list[str],
    run: Kernel,
    rates: dict[torch.dtype, Tensor],
    decoupled: float,
    total: int,
) -> None:
    """``scaled_step`` for a group that fits one block: one scratch buffer holds every
    parameter's direction, zeroed once, the kernel runs once on all of them and one
    ``_foreach_addcmul_`` scales them in (small members: a step of a few calls)."""
    (buffer,) = opt._scratch(params[0], 1, total)
    buffer = buffer[:total].zero_()
    directions, offset = [], 0
    for p in params:
        directions.append(buffer[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    rate = rates[params[0].dtype]
    scales = [rate.view(-1, *([1] * (p.dim() - 1))) for p in params]
    if decoupled != 0:
        compat.foreach_mul_(params, [1 - s * decoupled for s in scales])
    states = [opt.state[p] for p in params]
    ts = {"param": directions, "grad": grads, **{k: [s[k] for s in states] for k in keys}}
    run(ts, [s["step"][0] for s in states])
    compat.foreach_addcmul_(params, directions, scales)
