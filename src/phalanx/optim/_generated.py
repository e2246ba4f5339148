"""The default mode's generated kernel: a rule's pure update compiled once, for large stacks.

Where torch's fused kernel cannot take a group (per-member values other than the rate on
small members, a mask, step counts split by an earlier mask, Lion) the eager step runs the
rule's arithmetic on cache-sized blocks, one torch operation a pass: 3 to 9 times torch's
fused kernel on the stacked tensors. Here the rule's own ``update`` (the function the captured
step traces), with every hyperparameter an (N,) tensor and the mask folded in, is compiled by
``torch.compile`` (inductor) into one loop over each stacked tensor, writing the parameter and
its state in place: 1.1-1.3x torch's fused kernel on the stacked tensors (4096 tiny members).

The compile costs seconds: 10-20 s the first time on a machine, 3-9 s in a later process
(inductor's on-disk cache), and every call pays ~0.1 ms of guards. So it runs only for a group
of ``GENERATED_ELEMENTS`` elements or more (a step of tens of milliseconds, where the blocked
arithmetic costs the compile back within a few hundred steps), on a CPU, and says so once a
process (``CompileWarning``). A compile that fails falls back to the blocked arithmetic, with a
``FallbackWarning``. Each member's result is the float rounding of its float64 update, as the
default mode promises; it does not depend on the other members.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from phalanx._warnings import CompileWarning, FallbackWarning, warn

from ._executors import dense_like

if TYPE_CHECKING:
    from ._base import MemberOptimizer

__all__ = ["GENERATED_ELEMENTS", "generated_applies", "generated_step", "prefers_generated"]

GENERATED_ELEMENTS = 1 << 24
"""Elements of a group from which the default mode compiles the rule's update rather than run
the blocked arithmetic: 16.7M elements (3,500 tiny 8-64-64-1 members), a step of ~20 ms at
torch's fused speed on one CPU thread."""

_compiled: dict[Any, Any] = {}  # a key's compiled function; "failed": the error, once
_announced: set[str] = set()


def _function(key: tuple) -> Any:
    """``_apply`` compiled for one rule, its options and whether a mask is folded in. Each
    key gets a code object of its own: TorchDynamo keeps its compiled graphs per code object,
    at most ``recompile_limit`` (8) of them, so rules and options must not share one."""
    fn = _compiled.get(key)
    if fn is None:
        rule, options, masked = key  # a name that is the same in every process (disk cache)
        flags = "_".join(f"{k}{int(v)}" for k, v in options if isinstance(v, bool))
        name = f"_apply_{rule.__name__}_{flags}_{'masked' if masked else 'all'}"
        code = _apply.__code__.replace(co_name=name)
        fresh = types.FunctionType(code, _apply.__globals__, code.co_name)
        fn = _compiled[key] = torch.compile(fresh, dynamic=True, fullgraph=True)
    return fn


def _apply(
    update: Any,
    options: dict[str, Any],
    p: Tensor,
    g: Tensor,
    state: dict[str, Tensor],
    h: dict[str, Tensor],
    active: Tensor | None,
) -> None:
    """The rule's pure update written into ``p`` and ``state`` (a masked member keeps its
    values): the function ``torch.compile`` turns into one loop over the tensors."""
    new = update(p, g, state, h, **options)
    for key, value in new.items():
        target = p if key == "param" else state[key]
        if active is not None:
            value = torch.where(active.view(-1, *([1] * (target.dim() - 1))), value, target)
        target.copy_(value)


def _flat(t: Tensor, n: int) -> Tensor:
    """A contiguous ``t`` as (N, M) on its memory, not a view: TorchDynamo guards a view's
    base (its shape and strides), which would compile the update again for each shape of
    parameter; an alias whose writes land in ``t`` compiles once for every (N, M)."""
    m = t.numel() // max(n, 1)
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias.set_(t.untyped_storage(), t.storage_offset(), (n, m), (m, 1))


def prefers_generated(group: dict[str, Any]) -> bool:
    """Whether a group with per-member rates is better stepped by the generated kernel than
    by torch's kernel into scratch (``_blocked.scaled_step``, two more passes): a large stack
    on a CPU (4096 tiny members, Adam: 1.3x torch's fused kernel on the stacked tensors
    against 1.5-1.9x)."""
    params = group["params"]
    if "failed" in _compiled or not params or params[0].device.type != "cpu":
        return False
    return sum(p.numel() for p in params) >= GENERATED_ELEMENTS


def generated_applies(opt: MemberOptimizer, group: dict[str, Any], params: list[Tensor]) -> bool:
    """Whether the default mode's step of ``group`` is the generated kernel: a large group on
    a CPU, its tensors contiguous and its state complete (SGD's buffer made), and no compile
    of it has failed in this process."""
    if "failed" in _compiled:
        return False
    if sum(p.numel() for p in params) < GENERATED_ELEMENTS:
        return False
    options = opt.options(group)
    for p in params:
        if p.device.type != "cpu" or not p.is_floating_point():
            return False
        state = opt.state[p]
        if any(name not in state for name in opt.state_names(**options)):
            return False  # a state the update starts (SGD's momentum set mid-training)
        if not dense_like(opt, p):
            return False
    return True


def generated_step(
    opt: MemberOptimizer,
    group: dict[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    active: Tensor | None,
) -> bool:
    """One step of ``group`` by the compiled update; False (nothing written) if it cannot
    compile here, which it says once with a ``FallbackWarning``."""
    name = type(opt).__name__
    if name not in _announced:
        _announced.add(name)
        warn(
            f"{opt._NAME}.step(): compiling this rule's update once (torch.compile) for a "
            f"stack of {sum(p.numel() for p in params):,} elements with per-member values or "
            "masks that torch's fused kernel cannot take: seconds now (10-20 s the first time "
            "on a machine, less when inductor's disk cache has it), then each step at about "
            "torch's fused speed. mode='torch' runs the blocked arithmetic, without a compile.",
            CompileWarning,
        )
    device = params[0].device
    h = opt.member_hyperparameters(group, device)
    options = opt.options(group)
    rule = type(opt).update
    keep = None if active is None else active.to(device)
    from ._arith import math_dtype

    fn = _function((type(opt), tuple(sorted(options.items())), keep is not None))
    done = 0
    try:
        for p, g in zip(params, grads, strict=True):
            n = p.shape[0]
            state = opt.state[p]
            part = {k: _flat(v, n) for k, v in state.items() if k != "step"}
            part["step"] = state["step"].to(math_dtype(device)) + 1
            fn(rule, options, _flat(p, n), _flat(g, n), part, h, keep)
            for t in (p, *(v for k, v in state.items() if k != "step")):
                torch.autograd.graph.increment_version(t)  # written through an alias
            if keep is None:
                state["step"].add_(1)
            else:
                state["step"].add_(keep)
            done += 1
    except Exception as e:  # no C++ compiler, an unsupported op: the blocked arithmetic
        if done:
            raise  # some parameters stepped already: not safe to fall back
        _compiled["failed"] = e
        warn(
            f"{opt._NAME}.step(): the generated kernel failed to compile "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the step "
            "runs the blocked arithmetic (same promise, slower).",
            FallbackWarning,
        )
        return False
    return True
