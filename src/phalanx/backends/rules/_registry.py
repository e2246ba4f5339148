"""The registry of phalanx's batching rules, the shell that runs them, and what a rule is.

A batching rule (:class:`BatchRule`) is a batching rule in the ordinary sense: it is told
which dim of each argument is batched and computes every batch element exactly as the
function would alone, whatever that batch is (the members, or a ``torch.func.vmap`` of the
user's wrapped around the stack). Each family file (``_linear``, ``_conv``, ...) defines its
rules and registers them beside their definitions with :func:`batch_rule` (a function of fixed
arguments) or :func:`register` (a hand-written :data:`Route`).

The shell: each rule runs inside a ``torch.autograd.Function`` with a ``vmap`` staticmethod
(torch's public extension point), so under ``torch.func.vmap`` torch calls the rule with the
physical tensors and their batch dims. Off the vmap path (no argument batched) the Function
computes the function itself; its backward then recomputes the function with autograd, so
first and second derivatives are the function's own. :class:`BatchedOps`, a
``TorchFunctionMode`` pushed for the duration of one call (thread-local, like the vmap levels
themselves), routes the registered functions to their rules.

Tables: ``CORRECTNESS`` (both vmap backends: where torch.func's own rule is not exact),
``SPEED`` (``fused``: the correctness rules and the batched layers) and ``EXPORT`` (added
while ``torch.export`` traces a vmapped call).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol

import torch
from torch.overrides import TorchFunctionMode

from phalanx import _torch_compat as compat
from phalanx.backends._memory import note_batched

Dims = Sequence[int | None]
"""The batch dim of each argument of a rule, None where the argument is not batched."""


class BatchRule(Protocol):
    """A batching rule: ``rule(n, dims, *args) -> (out, out_dims)``.

    Args:
        n: the batch size (the members, or an outer vmap's batch).
        dims: the batch dim of each of ``args``, None where one is not batched.
        *args: the function's arguments, every one passed positionally (defaults filled in),
            tensors as their physical (unwrapped) tensors.

    Returns:
        ``(out, out_dims)``: the outputs for every batch element, and where their batch dim
        is (an int per output tensor, None for an output that is not batched).
    """

    def __call__(self, n: int, dims: Dims, /, *args: Any) -> tuple[Any, Any]: ...


Route = Callable[[tuple, dict], Any]
"""What :class:`BatchedOps` calls for a registered function: its ``args`` and ``kwargs``."""

CORRECTNESS: dict[Any, Route] = {}
"""The rules both backends use: where torch.func's own rule is not exact."""
SPEED: dict[Any, Route] = {}
"""The fused backend's rules: the correctness rules and the batched layers."""
EXPORT: dict[Any, Route] = {}
"""Added to a vmapped call's rules while ``torch.export`` traces it."""

Table = Literal["correctness", "speed", "export"]


def register(func: Any, route: Route, *, table: Table) -> None:
    """Routes ``func`` to ``route`` in ``table`` (a correctness rule is a fused one too)."""
    if table == "export":
        EXPORT[func] = route
        return
    SPEED[func] = route
    if table == "correctness":
        CORRECTNESS[func] = route


def batch_rule(
    func: Any,
    names: Sequence[str],
    defaults: Mapping[str, Any],
    *,
    table: Table,
    computes: Callable[..., Any] | None = None,
) -> Callable[[BatchRule], BatchRule]:
    """Registers the decorated rule for ``func``, a function of the arguments ``names``.

    Args:
        func: the function routed (``F.linear``).
        names: its arguments in order; the rule receives every one positionally.
        defaults: the value of each argument a call may leave out.
        table: where it is registered (see :func:`register`).
        computes: what the Function computes off the vmap path, called with every argument
            positionally; ``func`` by default.
    """

    def registered(rule: BatchRule) -> BatchRule:
        register(func, positional(func, rule, names, defaults, computes), table=table)
        return rule

    return registered


# ----------------------------------------------------------------------------- rule helpers


def first(t: Any, d: int | None, n: int) -> Any:
    """``t`` with its batch dim first, ``(n, ...)``; an unbatched ``t`` expanded to it."""
    if t is None:
        return None
    return t.movedim(d, 0) if d is not None else t.expand(n, *t.shape)


def per_member(n: int, dims: Dims, func: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """``func`` on each batch element in turn: exact by construction, for what has no faster
    exact rule. Outputs (a tensor or a tuple of them) are stacked on dim 0."""
    unbound = [
        a.movedim(d, 0).unbind(0) if d is not None and isinstance(a, torch.Tensor) else None
        for a, d in zip(args, dims)
    ]
    outs = []
    for i in range(n):
        outs.append(func(*(a if u is None else u[i] for a, u in zip(args, unbound))))
    if isinstance(outs[0], torch.Tensor):
        return torch.stack(outs), 0
    stacked = tuple(None if col[0] is None else torch.stack(col) for col in zip(*outs))
    return stacked, tuple(None if t is None else 0 for t in stacked)


def member_first(y: torch.Tensor, d: int | None, n: int) -> torch.Tensor:
    """``y`` as a rule hands it back: the batch dim first and each batch element contiguous,
    as the function's output is for a member alone (its code may branch on
    ``is_contiguous()`` or ``view`` it). Copies only where ``y`` is not so already."""
    y = first(y, d, n)
    return y if y.is_contiguous() else y.contiguous()


_pending = threading.local()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """While ``torch.export`` traces a vmapped call: the checks rules assert (:func:`holds`)
    are put after the call, outside its vmap level.

    An exported graph enters and leaves the level with ops of its own; a check that raises
    between them would leave the serving process inside the level for good.
    """
    if not torch.compiler.is_exporting():
        yield
        return
    outer = getattr(_pending, "checks", None)
    checks: list[tuple[torch.Tensor, str]] = []
    _pending.checks = checks
    try:
        yield
    finally:
        _pending.checks = outer
    for ok, message in checks:
        compat.assert_async(ok, message)


def holds(condition: torch.Tensor, message: str) -> bool:
    """Whether ``condition`` (a bool tensor of one element) holds, read on a CPU; where its
    value cannot be read for free (a trace, another device) it is asserted with ``message``
    instead and True returned: the call then raises where the condition fails."""
    if condition.device.type == "cpu" and not compat.tracing():
        return bool(condition)
    checks = getattr(_pending, "checks", None)
    if checks is None:
        compat.assert_async(condition, message)
    else:
        checks.append((condition, message))
    return True


# --------------------------------------------------------------------------- the Function shell


def _tensors(args: Sequence[Any]) -> list[int]:
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]


def function(name: str, func: Callable[..., Any], rule: BatchRule) -> Any:
    """An autograd.Function computing ``func``, batched under vmap by ``rule``."""

    def forward(*args: Any) -> Any:
        return func(*args)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        where = _tensors(inputs)
        ctx.where = where
        ctx.inputs = [None if isinstance(a, torch.Tensor) else a for a in inputs]
        ctx.save_for_backward(*(inputs[i] for i in where))
        ctx.save_for_forward(*(inputs[i] for i in where))

    def jvp(ctx: Any, *tangents: Any) -> Any:
        # Forward-mode AD off the vmap path: torch.func.jvp of ``func`` itself.
        inputs = list(ctx.inputs)
        for i, t in zip(ctx.where, ctx.saved_tensors):
            inputs[i] = t
        moving = [i for i in ctx.where if tangents[i] is not None]

        def along(*xs: torch.Tensor) -> Any:
            full = list(inputs)
            for i, x in zip(moving, xs):
                full[i] = x
            return func(*full)

        primals = tuple(inputs[i] for i in moving)
        return torch.func.jvp(along, primals, tuple(tangents[i] for i in moving))[1]

    def backward(ctx: Any, *grads: Any) -> tuple:
        # Off the vmap path only: recompute ``func`` with autograd and differentiate that,
        # so the gradients (and their own derivatives under create_graph) are ``func``'s.
        saved = ctx.saved_tensors
        inputs = list(ctx.inputs)
        wanted = [
            i for i, need in zip(ctx.where, [ctx.needs_input_grad[i] for i in ctx.where]) if need
        ]
        with torch.enable_grad():
            leaves = {}
            for i, t in zip(ctx.where, saved):
                leaves[i] = t.detach().requires_grad_(i in wanted) if t.is_floating_point() else t
                inputs[i] = leaves[i]
            out = func(*inputs)
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            got = (
                torch.autograd.grad(
                    [o for o, _ in pairs],
                    [leaves[i] for i in wanted],
                    [g for _, g in pairs],
                    create_graph=torch.is_grad_enabled(),
                    allow_unused=True,
                )
                if pairs and wanted
                else [None] * len(wanted)
            )
        result: list[Any] = [None] * len(inputs)
        for i, g in zip(wanted, got):
            result[i] = g
        return tuple(result)

    def vmap(info: Any, in_dims: tuple, *args: Any) -> Any:
        out = rule(info.batch_size, in_dims, *args)
        # all members' activations, freed and allocated again every step: kept for reuse
        # once one is large enough for malloc to map it afresh each time (``_memory``)
        note_batched((*args, *(out[0] if isinstance(out[0], tuple) else (out[0],))))
        return out

    return type(
        name,
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "jvp": staticmethod(jvp),
            "vmap": staticmethod(vmap),
        },
    )


def positional(
    func: Callable[..., Any],
    rule: BatchRule,
    names: Sequence[str],
    defaults: Mapping[str, Any],
    computes: Callable[..., Any] | None = None,
) -> Route:
    """The route of a function of fixed arguments, called through one Function."""
    computes = func if computes is None else computes
    fn = function(func.__name__, computes, rule)

    def route(args: tuple, kwargs: dict) -> Any:
        values = dict(zip(names, args))
        values.update(kwargs)
        full = tuple(values.get(k, defaults.get(k)) for k in names)
        if torch.compiler.is_exporting():  # torch.export cannot trace the Function under vmap
            out = compat.vmap_rule_inline(computes, rule, full)
            if out is not None:
                return out
        return fn.apply(*full)

    return route


# ------------------------------------------------------------------------------- the mode


class BatchedOps(TorchFunctionMode):
    """Routes the functions in ``rules`` to phalanx's batching rules for one call."""

    def __init__(self, rules: Mapping[Any, Route], module: Any = None) -> None:
        super().__init__()
        self.rules = rules
        self.module = module  # the member's module tree, to name a generator it holds

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.requires_grad_ and _fresh_leaf(args, kwargs):
            # A constant the forward made itself (``h0 = zeros(...).requires_grad_()``, as
            # GRU tutorials write it): a leaf no one outside the forward can differentiate
            # against. torch.func refuses ``requires_grad_`` inside a transform; leave it as is.
            return args[0]
        if kwargs and isinstance(kwargs.get("generator"), torch.Generator):
            _refuse_generator(func, kwargs["generator"], self.module)
        rule = self.rules.get(func)
        if rule is None:
            return func(*args, **(kwargs or {}))
        return rule(tuple(args), kwargs or {})


def _refuse_generator(func: Any, generator: torch.Generator, module: Any) -> None:
    """A draw from a ``torch.Generator`` object (one the member holds, or makes and seeds in
    its forward): one vmapped call would draw every member's numbers from that one stream at
    once; each member alone draws its own from it. Refused before anything is drawn."""
    from phalanx.backends._guard import random_refusal

    held = [
        f"{path}.{key}" if path else key
        for path, sub in (module.named_modules() if module is not None else ())
        for key, value in vars(sub).items()
        if value is generator
    ]
    whose = f"{held[0]!r}, which the member holds" if held else "one the forward makes"
    why = (
        f"the member's forward draws from a torch.Generator object ({whose}; "
        f"{getattr(func, '__name__', func)}(generator=...)), and one vmapped call draws every "
        f"member's numbers from it at once; the loop draws each member's as it draws alone"
    )
    raise random_refusal("the vmapped backends", why)


def _fresh_leaf(args: Any, kwargs: Any) -> bool:
    want = (
        kwargs.get("requires_grad", args[1] if len(args) > 1 else True)
        if kwargs
        else (args[1] if len(args) > 1 else True)
    )
    t = args[0]
    return bool(want) and not t.requires_grad and not compat.is_wrapped(t)
