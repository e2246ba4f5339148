"""The whole training step as one function of tensors, written to be traced and compiled.

:func:`step_function` returns a function of the step's tensors (stacked parameters, buffers,
optimizer state, hyperparameters, inputs, target, mask) that runs the forward pass through the
stack, the per-member losses, the gradients, clipping, non-finite isolation and the
optimizer's update rule (its pure ``update``, the one the eager step runs), and writes the results into the tensors it was given, in place. Tracing it with
``make_fx`` gives one graph of aten operations, backward included; that graph is what
``torch.compile`` compiles (see ``_step.py``).

Every operation mirrors the eager path operation for operation: ``phalanx.clip_grad_norm_``,
``MemberOptimizer._isolate`` and the optimizer's own ``update`` with per-member
hyperparameters, so that the captured step equals the eager one to float rounding. The
hyperparameters are (N,) float64 tensors, inputs of the graph: a scheduler that changes a
learning rate changes an input, not the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call

from phalanx._torch_compat import pytree
from phalanx.optim._arith import finite_members, isolate, per_member
from phalanx.train._clip import clip_coefficients, member_norms
from phalanx.train._losses import member_losses


@dataclass(frozen=True)
class Plan:
    """What the traced step is specialised to: everything about it but tensor values.

    Attributes:
        stack: the :class:`phalanx.Stack` (its forward is called through ``functional_call``).
        loss_fn: a loss on one member's ``(B, ...)`` output, as for ``member_losses``.
        param_names: the stack's parameter names, in ``named_parameters()`` order.
        trainable: per parameter, whether it requires grad.
        buffer_names: the stack's buffer names.
        in_dims: per positional input, None (shared) or 0 (per-member).
        target_dim: None (a target shared by every member) or 0 (per-member).
        update: the optimizer's rule, ``MemberOptimizer.update`` of its class (pure); None
            where the optimizer's own step applies the gradients the graph returns (an
            optimizer with ``fused=True``: torch's fused kernel, which a trace cannot hold).
        options: per parameter, the ``options`` of its group that ``update`` branches on.
        max_norm: clip each member's gradient norm (the value is an input tensor).
        norm_type: the p of the clipping norm.
        masked: a step mask is an input.
        isolate: skip members whose loss or gradients are not finite.
        freeze_after: with ``isolate``, freeze a member after this many skipped steps.
        keywords: the names of the keyword inputs, which follow the positional ones in "args".
        kw_in_dims: as in ``Stack.forward``.
    """

    stack: Any
    loss_fn: Callable[..., Tensor] | None
    param_names: tuple[str, ...]
    trainable: tuple[bool, ...]
    buffer_names: tuple[str, ...]
    in_dims: tuple[int | None, ...]
    target_dim: int | None
    update: Callable[..., dict[str, Tensor]] | None
    options: tuple[dict[str, Any], ...]
    max_norm: bool
    norm_type: float
    masked: bool
    isolate: bool
    freeze_after: int | None
    keywords: tuple[str, ...] = ()
    kw_in_dims: Any = None


#: Marks a tensor input of the graph in ``Layout.args`` and ``Layout.target``.
INPUT = type("Input", (), {"__repr__": lambda self: "INPUT"})()
#: What the step returns, in this order, each where the plan asks for it.
OUTPUTS = ("losses", "norms", "skipped", "frozen")


@dataclass(frozen=True)
class Layout:
    """Where each of the step's tensors lies in the one flat list the compiled graph takes.

    The graph is called with positional tensors, not a dict: a compiled function called
    directly (without TorchDynamo's frame evaluation and pytree flattening) costs a fraction
    of one that is called through ``torch.compile``'s wrapper, and for a tiny step that
    wrapper was half the time. :func:`flatten` and :func:`unflatten` are each other's inverse.

    Attributes:
        num_params: P, the stack's parameters.
        num_buffers: the stack's buffers.
        state_keys: per parameter, the keys of its optimizer state in the flat list (sorted;
            empty for a frozen parameter).
        hypers: per parameter, the names of its (N,) hyperparameters that are inputs (the
            rule's ``HYPERPARAMETERS``; empty for a frozen parameter).
        args: per positional input, ``INPUT`` where it is a tensor (a graph input), else
            the value itself, a constant of the graph.
        target: ``(spec, leaves)``: the target's pytree structure (a tensor, or a tuple,
            list or dict of them such as ``(y, mask)``) and per leaf what ``args`` holds.
        masked, clipped, isolated: whether the mask, the (N,) max_norm, and the optimizer's
            ``bad_steps`` and ``frozen`` counters are inputs.
        outputs: the names of ``OUTPUTS`` the graph returns, in that order.
        grads: where the optimizer's step applies the update outside the graph
            (``Plan.update`` None), the parameters whose gradients the graph returns after
            the outputs, by index.
    """

    num_params: int
    num_buffers: int
    state_keys: tuple[tuple[str, ...], ...]
    hypers: tuple[tuple[str, ...], ...]
    args: tuple[Any, ...]
    target: Any
    masked: bool
    clipped: bool
    isolated: bool
    outputs: tuple[str, ...] = ()
    grads: tuple[int, ...] = ()


def layout_of(t: dict[str, Any]) -> Layout:
    """The layout of a dict of the step's tensors (see :func:`step_function`)."""

    def constant(v: Any) -> Any:
        return INPUT if isinstance(v, Tensor) else v

    return Layout(
        num_params=len(t["params"]),
        num_buffers=len(t["buffers"]),
        state_keys=tuple(tuple(sorted(s)) for s in t["state"]),
        hypers=tuple(tuple(h) for h in t["hypers"]),
        args=tuple(constant(a) for a in t["args"]),
        target=_target_layout(t["target"]),
        masked=t["mask"] is not None,
        clipped=t["max_norm"] is not None,
        isolated=t["bad_steps"] is not None,
    )


def _target_layout(target: Any) -> tuple[Any, tuple[Any, ...]]:
    leaves, spec = pytree.tree_flatten(target)
    return spec, tuple(INPUT if isinstance(x, Tensor) else x for x in leaves)


def flatten(layout: Layout, t: dict[str, Any]) -> list[Tensor]:
    """The step's tensors (the dict of :func:`step_function`) as the flat list of ``layout``:
    the compiled graph's arguments."""
    flat = [*t["params"], *t["buffers"]]
    for state, keys in zip(t["state"], layout.state_keys):
        flat += [state[k] for k in keys]
    for h, names in zip(t["hypers"], layout.hypers):
        flat += [h[k] for k in names]
    flat += [a for a, c in zip(t["args"], layout.args) if c is INPUT]
    leaves = pytree.tree_leaves(t["target"])
    flat += [x for x, c in zip(leaves, layout.target[1], strict=True) if c is INPUT]
    if layout.masked:
        flat.append(t["mask"])
    if layout.clipped:
        flat.append(t["max_norm"])
    if layout.isolated:
        flat += [t["bad_steps"], t["frozen"]]
    return flat


def unflatten(layout: Layout, flat: list[Tensor] | tuple[Tensor, ...]) -> dict[str, Any]:
    """The dict of :func:`step_function` from the flat list of ``layout``."""
    it = iter(flat)

    def take(k: int) -> list[Tensor]:
        return [next(it) for _ in range(k)]

    t: dict[str, Any] = {"params": take(layout.num_params), "buffers": take(layout.num_buffers)}
    t["state"] = [dict(zip(keys, take(len(keys)))) for keys in layout.state_keys]
    t["hypers"] = [dict(zip(names, take(len(names)))) for names in layout.hypers]
    t["args"] = [next(it) if c is INPUT else c for c in layout.args]
    spec, consts = layout.target
    t["target"] = pytree.tree_unflatten([next(it) if c is INPUT else c for c in consts], spec)
    t["mask"] = next(it) if layout.masked else None
    t["max_norm"] = next(it) if layout.clipped else None
    t["bad_steps"], t["frozen"] = take(2) if layout.isolated else (None, None)
    rest = list(it)
    assert not rest, f"{len(rest)} tensors beyond the layout"
    return t


def _clip(grads: list[Tensor], max_norm: Tensor, norm_type: float, n: int) -> Tensor:
    """``phalanx.clip_grad_norm_`` on gradient values: returns the (N,) norms, scales grads."""
    total = member_norms(grads, n, norm_type)
    coef = clip_coefficients(max_norm.to(total.dtype), total)
    for k, g in enumerate(grads):
        grads[k] = g * per_member(coef, g)
    return total


def _update(
    plan: Plan, k: int, p: Tensor, g: Tensor, state: dict[str, Tensor], h: dict[str, Tensor]
) -> dict[str, Tensor]:
    """One update of stacked parameter ``k``, nothing written yet: the optimizer's own rule,
    with the (N,) hyperparameters the graph takes as inputs and "step" counting this step."""
    step = state["step"] + 1
    assert plan.update is not None
    new = plan.update(p, g, {**state, "step": step}, h, **plan.options[k])
    unknown = sorted(set(new) - {"param", *state})
    if unknown:
        raise ValueError(
            f"the update rule starts optimizer state {unknown} that the parameter does not "
            f"have yet; the eager step creates it, so run one eager step first"
        )
    return {**new, "step": step}


def step_function(plan: Plan) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The step as a function of a dict of tensors, for ``make_fx``.

    The dict holds "params" (P stacked tensors), "buffers", "state" (per parameter, its
    optimizer state), "hypers" (per parameter, its rule's (N,) hyperparameters by name),
    "args" (the inputs), "target", "mask" ((N,) bool or None), "max_norm" ((N,) or None),
    "bad_steps" and "frozen" ((N,) counters of the optimizer, or None).

    The function writes the new parameters, optimizer state, buffers and counters into the
    given tensors and returns "losses" (N,), "norms" (N,) (clipping), "skipped" and "frozen"
    (N,) bool (isolation: members skipped, members frozen by this step), None when not asked
    for. Without an update rule (``plan.update`` None) it writes the buffers only and returns
    "grads" too: (index, gradient after clipping) of each parameter that has one.
    """
    names = plan.param_names

    def step(t: dict[str, Any]) -> dict[str, Any]:
        params: list[Tensor] = t["params"]
        n = params[0].shape[0]
        leaves = [p.detach().requires_grad_(r) for p, r in zip(params, plan.trainable)]
        tensors = {**dict(zip(names, leaves)), **dict(zip(plan.buffer_names, t["buffers"]))}
        with torch.enable_grad():
            args, keywords = split_keywords(t["args"], plan.keywords)
            call = {"in_dims": plan.in_dims, "kw_in_dims": plan.kw_in_dims, **keywords}
            out = functional_call(plan.stack, tensors, args, call)
            losses = member_losses(plan.loss_fn, out, t["target"], in_dims=(0, plan.target_dim))
            wanted = [k for k, r in enumerate(plan.trainable) if r]
            found = torch.autograd.grad(
                losses.sum(), [leaves[k] for k in wanted], allow_unused=True
            )
        # A parameter without a gradient is left alone, as the eager optimizer leaves it.
        with_grad = [(k, g) for k, g in zip(wanted, found) if g is not None]
        grads = [g for _, g in with_grad]
        losses = losses.detach()
        norms = None
        if plan.max_norm and grads:
            norms = _clip(grads, t["max_norm"], plan.norm_type, n)
        if plan.update is None:  # the optimizer's own step applies them
            return {"losses": losses, "norms": norms, "skipped": None, "frozen": None,
                    "grads": [(k, g) for (k, _), g in zip(with_grad, grads)]}  # fmt: skip
        active, skipped, newly_frozen = t["mask"], None, None
        if plan.isolate:
            finite = finite_members(grads, n, losses.device) & losses.isfinite()
            active, skipped, newly_frozen = isolate(
                finite, active, t["frozen"], t["bad_steps"], plan.freeze_after
            )
        with torch.no_grad():
            for (k, _), g in zip(with_grad, grads):  # the gradients after clipping
                p, state = params[k], t["state"][k]
                new = _update(plan, k, p, g, state, t["hypers"][k])
                targets = {"param": p, **state}
                for key, value in new.items():
                    if active is not None:
                        value = torch.where(per_member(active, value), value, targets[key])
                    targets[key].copy_(value)
        return {"losses": losses, "norms": norms, "skipped": skipped, "frozen": newly_frozen}

    return step


def split_keywords(args: Any, names: tuple[str, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` holds the positional inputs followed by the keyword inputs called ``names``."""
    args = tuple(args)
    if not names:
        return args, {}
    p = len(args) - len(names)
    return args[:p], dict(zip(names, args[p:]))


# ------------------------------------------------------------------- rewrites of the graph

_aten = torch.ops.aten


NARROW = 16
"""Fewer output columns than this make a CPU ``bmm`` product narrow (see :func:`narrow_product`)."""
NARROW_ELEMENTS = 1 << 22
"""The most elements (16 MiB of float32) of ``a`` in a narrow product that is rewritten."""


def narrow_product(a: Any, b: Any) -> bool:
    """Whether ``bmm(a, b)`` of float32 CPU tensors ``a (N, M, K)``, ``b (N, K, C)`` runs faster
    as ``bmm(b^T, a^T)^T``: ``C < 16 <= M / 2``, ``K <= 64`` and ``a`` at most
    :data:`NARROW_ELEMENTS`. torch's CPU GEMM for small products is slow when the output has
    few columns and many rows (a SIMD register holds 16 floats); the transposed product swaps
    them. Measured on this project's CPU, 1 thread, N = 16 and 400, M 8-512, K 10-256, C 1-256
    (``benchmarks/captured_step_rewrites.py sweep``, issue 26's sixth session): of the 85 measured
    shapes in that region 84 ran faster transposed, 1.04x to 6.6x (W1's (32, 20) x (20, 10):
    447 against 162 us for 400 products), one at 0.89x (N = 400, (128, 64) x (64, 4)); with
    few rows and many columns the transposed product took up to 5x longer, with ``a`` of
    52 MB or more up to 2.6x, so those are not rewritten. A static rule, from shapes only: no
    timing."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.device.type != "cpu" or a.dtype != torch.float32 or a.dim() != 3 or b.dim() != 3:
        return False
    n, m, k, c = a.shape[0], a.shape[1], a.shape[2], b.shape[2]
    if not all(type(d) is int for d in (n, m, k, c)):  # symbolic sizes: no guard on them
        return False
    return c < NARROW and m >= 2 * NARROW and k <= 64 and n * m * k <= NARROW_ELEMENTS


def simplify(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrites of the traced step, each measured faster on a CPU:

    - ``baddbmm(c, a, b)`` becomes ``c + bmm(a, b)``, value for value: aten's baddbmm took
      1.8x the time of bmm for W1's 400 products of (32, 20) and (20, 10), while the compiler
      fuses the addition into the pointwise kernel that follows.
    - a ``bmm`` whose products are narrow (:func:`narrow_product`) runs as the transposed
      product, ``bmm(b^T, a^T)^T``, copied back to the original layout: to float rounding,
      as the rest of the compiled step (each entry is the same sum of the same products, in
      the order the GEMM kernel picks).

    Args:
        graph: a ``make_fx`` graph (nodes carry their ``meta["val"]``); changed in place.

    Returns:
        The same graph, recompiled.
    """
    g = graph.graph
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target is _aten.baddbmm.default and len(node.args) == 3 and not node.kwargs:
            c, a, b = node.args
            with g.inserting_before(node):
                product = g.call_function(_aten.bmm.default, (a, b))
                total = g.call_function(_aten.add.Tensor, (c, product))
            product.meta, total.meta = {}, dict(node.meta)
            node.replace_all_uses_with(total)
            g.erase_node(node)
    for node in list(g.nodes):  # a pass of its own: it also sees the bmm made from baddbmm
        if node.op == "call_function" and node.target is _aten.bmm.default and not node.kwargs:
            a, b = node.args
            known = isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)
            if known and narrow_product(a.meta.get("val"), b.meta.get("val")):
                with g.inserting_before(node):
                    at = g.call_function(_aten.transpose.int, (a, 1, 2))
                    bt = g.call_function(_aten.transpose.int, (b, 1, 2))
                    product = g.call_function(_aten.bmm.default, (bt, at))
                    back = g.call_function(_aten.transpose.int, (product, 1, 2))
                    same = g.call_function(
                        _aten.clone.default, (back,), {"memory_format": torch.contiguous_format}
                    )
                for new in (at, bt, product, back):
                    new.meta = {}
                same.meta = dict(node.meta)
                node.replace_all_uses_with(same)
                g.erase_node(node)
    g.eliminate_dead_code()
    g.lint()
    graph.recompile()
    return graph
