"""The segment path: a member's forward proven row-wise by its structure and run once over all
sorted rows.

The forward is traced once with ``torch.fx`` (again only when its fingerprint, what the trace
baked in, changes) and compiled into ``Step`` s against the live modules; running the steps
calls the operations of ``_rowwise_ops``, each of which proves itself row-wise or raises
``NotRowwise`` (then the general path runs). Nothing is compared against a reference at run
time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from phalanx import _torch_compat as compat
from phalanx._errors import summary
from phalanx._module_tree import meta_copy
from phalanx._torch_compat import pytree
from phalanx._warnings import FallbackWarning, warn
from phalanx.backends._state import _INTERNALS, hooked
from phalanx.routed._checks import Routing
from phalanx.routed._direct import Direct, MemberViews, compile_direct
from phalanx.routed._general import concat
from phalanx.routed._rowwise_ops import (
    IN_PLACE,
    MemberTensor,
    RowTensor,
    call_module,
    call_op,
    in_place,
    leaves,
    map_leaves,
    unwrap,
)
from phalanx.routed._scatter import scatter
from phalanx.routed._segments import NotRowwise, Segments, per_segment, segment_linear

if TYPE_CHECKING:
    from phalanx.backends import StackView

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)
_NO_DEFAULT = object()


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _frozen(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_frozen(v) for v in value))
    return value


def _fingerprint(module: nn.Module) -> tuple | str:
    """What a trace bakes in: the module tree (each submodule's identity and type, and
    whether it holds hooks, which ``checked_plan`` reads from the plan) and, for
    the modules the trace runs through (fx calls torch.nn's own layers as they are, reading
    their settings on every call), their mode and plain attributes; a string (the reason)
    when such a module holds an attribute whose changes a trace could not see."""

    leaf = _LEAF.is_leaf_module
    has_hooks = compat.has_hooks
    parts: list[Any] = []
    for path, m in module.named_modules():
        if leaf(m, path):
            parts.append((path, id(m), has_hooks(m)))
            continue
        own = []
        for k, v in m.__dict__.items():
            if k in _INTERNALS:
                continue
            if _plain(v):
                own.append((k, _frozen(v)))  # a copy: a list changed in place is a change
            elif callable(v) and not isinstance(v, (nn.Module, torch.Tensor)):
                own.append((k, id(v)))
            else:
                return (
                    f"{type(m).__name__} {path or 'the member'} holds {k!r}, a {type(v).__name__}"
                )
        parts.append((path, id(m), type(m), m.training, has_hooks(m), tuple(own)))
    return tuple(parts)


_LEAF = torch.fx.Tracer()
_IMMUTABLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)


def _immutable(value: Any) -> bool:
    if type(value) is tuple:
        return all(_immutable(v) for v in value)
    return isinstance(value, _IMMUTABLE)


Witness = tuple[nn.Module, list[tuple[nn.Module, type, int, list[tuple[str, Any]], list, list]]]
"""The objects a fingerprint was taken from (``_witness``): the root and, per module of the
walk, its type, the size of its ``__dict__``, its own attributes, its hook dicts and its
children."""


def _witness(module: nn.Module) -> Witness | None:
    """What ``_unchanged`` compares by identity on every call instead of taking the
    fingerprint again; None where an attribute the fingerprint reads is mutable (a list,
    whose contents could change under the same identity) or a module holds hooks: then
    every call takes it."""
    walk = []
    for m in module.modules():
        hooks = compat.module_hooks(m)
        if any(hooks.values()):
            return None
        own = [*hooks.items(), ("_modules", compat.own_children(m))]
        for k, v in m.__dict__.items():
            if k in _INTERNALS and k != "training":
                continue
            if not _immutable(v) and not (
                callable(v) and not isinstance(v, (nn.Module, torch.Tensor))
            ):
                return None
            own.append((k, v))
        children = list(compat.own_children(m).items())
        walk.append((m, type(m), len(m.__dict__), own, list(hooks.values()), children))
    return module, walk


def _unchanged(witness: Witness, module: nn.Module) -> bool:
    """Whether the module tree is the one ``witness`` was taken from, every module with the
    same type, the same attribute objects (``is``: a value set again, even equal, answers
    False, and the caller takes the fingerprint), the same hook dicts still empty and the
    same children under the same names: then its fingerprint is the same, without walking
    it afresh."""
    root, walk = witness
    if module is not root:
        return False
    for m, kind, size, own, hooks, children in walk:
        d = m.__dict__
        if type(m) is not kind or len(d) != size:
            return False
        for k, v in own:  # the hook dicts and the children's dict among them
            if d.get(k, _MISSING) is not v:
                return False
        for h in hooks:
            if h:
                return False
        if children:
            now = compat.own_children(m)
            if len(now) != len(children):
                return False
            for (k, c), (k2, c2) in zip(children, now.items()):
                if c is not c2 or k != k2:
                    return False
        elif compat.own_children(m):
            return False
    return True


_MISSING = object()


class Plan:
    def __init__(self, fingerprint: Any, graph: Any, constants: Any) -> None:
        self.fingerprint = fingerprint
        self.graph = graph
        self.constants = constants  # the traced module, for tensor constants it recorded
        self.refused: dict[Any, str] = {}  # per input signature
        self.steps: list[Step] | None = None  # the graph compiled against the live modules
        self.placeholders = 0
        self.proven: set[Any] = set()  # input signatures run_plan has run through
        self.direct: Direct | bool | None = True  # True until compiled; None: not compilable
        self.hooked = False  # a module of the tree held hooks when the fingerprint was taken
        self.witness: Witness | None = None  # what the fingerprint was taken from
        # whether the forward writes a positional input in place (``x /= 2``, which torch.fx
        # records as ``x = x / 2``); None until a subset call asks (``_subsets``)
        self.writes_inputs: bool | None = None


def direct_of(plan: Plan, view: StackView, signature: Any) -> Direct | None:
    """The member's forward as one generated function (``_direct``), once ``run_plan`` has
    proven the trace row-wise for inputs of this signature; None before, or where the
    rewrite does not apply."""
    if signature not in plan.proven:
        return None
    if plan.direct is True:
        plan.direct = compile_direct(plan.graph, view.module, plan.constants)
    return plan.direct if isinstance(plan.direct, Direct) else None


def _loader(value: Any, index: dict[Any, int]) -> Loader:
    """A function from the values computed so far to ``value`` with its nodes filled in."""
    node_type = torch.fx.Node
    if isinstance(value, node_type):
        i = index[value]
        return lambda env: env[i]
    if not any(isinstance(v, node_type) for v in leaves(value)):
        return lambda env: value
    if type(value) in (tuple, list) and not any(
        isinstance(v, (tuple, list, dict, slice)) for v in value
    ):
        items = [(True, index[v]) if isinstance(v, node_type) else (False, v) for v in value]
        kind = type(value)
        return lambda env: kind(env[v] if ref else v for ref, v in items)
    if type(value) is dict and not any(
        isinstance(v, (tuple, list, dict, slice)) for v in value.values()
    ):
        entries = [
            (k, True, index[v]) if isinstance(v, node_type) else (k, False, v)
            for k, v in value.items()
        ]
        return lambda env: {k: env[v] if ref else v for k, ref, v in entries}
    return lambda env: map_leaves(lambda a: env[index[a]] if isinstance(a, node_type) else a, value)


Loader = Callable[[list[Any]], Any]
"""A function from the values computed so far (one per step, in order) to an argument."""


class Step(NamedTuple):
    """One node of the traced forward, compiled against the live modules.

    Attributes:
        op: fx's node op (``"placeholder"``, ``"get_attr"``, ``"call_module"``,
            ``"call_function"``, ``"call_method"``, ``"output"``), or ``"activation"`` for an
            activation module that may run inside the Linear before it (see ``linear``).
        target: the placeholder's position, the attribute's path, the live module, or fx's
            function or method name.
        args: the loader of the positional arguments (of the output value for ``"output"``).
        kwargs: the loader of the keyword arguments.
        default: a placeholder's default value (``_NO_DEFAULT`` when it has none).
        activation: on a Linear whose one user is an activation module, that module: it runs
            in place inside the Linear's segment loop where no autograd graph is recorded.
        linear: on an ``"activation"`` step, the index of the Linear step before it, whose
            value it passes on when the activation already ran there.
    """

    op: str
    target: Any
    args: Loader | None = None
    kwargs: Loader | None = None
    default: Any = _NO_DEFAULT
    activation: nn.Module | None = None
    linear: int | None = None


def _compile(plan: Plan, live: nn.Module) -> list[Step]:
    """The graph as ``Step`` s against the live modules, with each Linear that an in-place
    activation module alone reads paired with it (``Step.activation`` / ``Step.linear``)."""
    nodes = list(plan.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    steps: list[Step] = []
    placeholder = 0
    for n in nodes:
        if n.op == "placeholder":
            default = n.args[0] if n.args else _NO_DEFAULT
            steps.append(Step("placeholder", placeholder, default=default))
            placeholder += 1
        elif n.op == "get_attr":
            steps.append(Step("get_attr", n.target))
        elif n.op == "call_module":
            mod = live.get_submodule(n.target)
            args, kwargs = _loader(n.args, index), _loader(n.kwargs, index)
            source = n.args[0] if len(n.args) == 1 and not n.kwargs else None
            if (
                type(mod) in IN_PLACE
                and isinstance(source, torch.fx.Node)
                and source.op == "call_module"
                and type(live.get_submodule(source.target)) is nn.Linear  # type: ignore[arg-type]
                and len(source.users) == 1
                and len(source.args) == 1
                and not source.kwargs
            ):
                linear = index[source]
                steps[linear] = steps[linear]._replace(activation=mod)
                steps.append(Step("activation", mod, args, kwargs, linear=linear))
                continue
            steps.append(Step("call_module", mod, args, kwargs))
        elif n.op in ("call_function", "call_method"):
            steps.append(Step(n.op, n.target, _loader(n.args, index), _loader(n.kwargs, index)))
        elif n.op == "output":
            steps.append(Step("output", None, _loader(n.args[0], index)))
    plan.placeholders = placeholder
    return steps


def plan_of(view: StackView) -> Plan | str:
    """The member's forward traced once (again only when a baked-in attribute changed)."""
    cache = view.cache_of("routed")
    plan = cache.get("plan")
    if plan is not None and plan.witness is not None and _unchanged(plan.witness, view.module):
        return plan  # the tree the fingerprint was taken from, unchanged
    fingerprint = _fingerprint(view.module)
    if isinstance(fingerprint, str):
        return fingerprint
    if plan is not None and plan.fingerprint == fingerprint:
        plan.witness = _witness(view.module)
        return plan

    copied = meta_copy(view.module)
    state = [*copied.named_parameters(), *copied.named_buffers()]
    versions = [compat.version(t) for _, t in state]
    try:
        traced = torch.fx.symbolic_trace(copied)
    except Exception as e:  # control flow on data, an untraceable call: the general path
        plan = Plan(fingerprint, None, None)
        plan.refused[None] = f"torch.fx cannot trace the member's forward ({summary(e)})"
    else:
        plan = Plan(fingerprint, traced.graph, traced)
        # An in-place write to a parameter or buffer that reads no input (a step counter,
        # an EMA) runs on the traced copy and is left out of the graph: the segment path
        # would drop it, so such a forward takes the general path, which writes as the loop.
        written = [k for (k, t), v in zip(state, versions) if compat.version(t) != v]
        if written:
            plan.refused[None] = f"the forward writes {written[0]!r} in place"
    plan.hooked = bool(hooked(view.module))  # the fingerprint holds each module's hook flag
    plan.witness = _witness(view.module)
    cache["plan"] = plan
    return plan


_HOOKED = "the member holds hooks, which must run once per member"


def checked_plan(view: StackView, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan | str:
    """The plan for this call, or the reason the segment path does not apply: ``blocked``'s
    checks and ``plan_of`` in one walk of the module tree (the fingerprint, checked on every
    call, holds each module's hook flag)."""
    reason = blocked(view, args, kwargs, hooks=False)
    if reason is not None:
        return reason
    plan = plan_of(view)
    if isinstance(plan, str):
        return _HOOKED if hooked(view.module) else plan
    if plan.hooked or compat.global_module_hooks():
        return _HOOKED
    if plan.graph is not None and not getattr(plan, "generators_checked", False):
        plan.generators_checked = True  # type: ignore[attr-defined]
        drawn = _generator_draw(plan.graph)
        if drawn is not None:
            plan.refused.setdefault(None, drawn)
    return plan


def _generator_draw(graph: Any) -> str | None:
    """Why the trace cannot run: it draws from a ``torch.Generator`` object (one the forward
    makes and seeds: the trace kept the one made while tracing, one stream for every row);
    each member alone draws from its own, on its own rows (the general path does so)."""
    for node in graph.nodes:
        if any(isinstance(a, torch.Generator) for a in (*node.args, *node.kwargs.values())):
            return f"the forward draws from a torch.Generator object ({node.name!r})"
    return None


def segment_path(
    view: StackView,
    requested: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    routing: Routing,
) -> tuple[Any, bool] | None:
    """The trace run over the sorted rows, or None (then the general path runs): the
    outputs, and whether they are already in the input's order and combined over the k
    choices (the per-segment runs scatter each segment's rows into place) or still in
    segment order (``_routed._combine`` puts them back)."""
    plan = checked_plan(view, args, kwargs)
    reason = plan if isinstance(plan, str) else None
    signature = tuple((a.dim(), a.dtype) for a in args)
    if not isinstance(plan, str):
        reason = plan.refused[None] if None in plan.refused else plan.refused.get(signature)
    if reason is None:
        assert isinstance(plan, Plan)
        seg = routing.derived.get("segments")
        if seg is None:
            seg = routing.derived["segments"] = Segments.of(routing, view.num_members)
        if len(seg.members) == 1 or per_segment(len(seg.members), seg.rows):
            direct = direct_of(plan, view, signature)
            if direct is not None:
                return direct_segments(direct, args, routing, seg), True
        gathered = routing.gather(args)
        try:
            out = run_segments(plan, view, gathered, seg)
        except NotRowwise as e:
            reason = str(e)
            plan.refused[signature] = reason
        else:
            plan.proven.add(signature)
            return out, False
    if requested == "fused":
        _warn_once(view, reason)
    return None


def direct_segments(
    direct: Direct, args: tuple[torch.Tensor, ...], routing: Routing, seg: Segments
) -> Any:
    """Each member's own forward on its own rows (``_direct``), each segment's outputs put in
    place as they come: rows gathered per segment (a view where the routing keeps the rows in
    order), outputs added into their rows (``index_add_``, weighted, the k choices summed in
    member order) or, in order, joined."""
    views = MemberViews(direct, seg.members, seg.num_members)
    in_order = routing.in_order
    counts = seg.count_list
    # Each input's rows in segment order, split into the segments in one call (one autograd
    # node, whose backward joins the segments' gradients): views of the input where the
    # routing keeps the rows in order, else of one gather. A forward that writes its input
    # gets rows of its own per segment (a copy, as the loop's ``x[index == i]``): views
    # of one tensor share a version counter, and split's views refuse in-place writes.
    if direct.writes:
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)
        split = [
            [a.index_select(0, routing.source_rows.narrow(0, s, c)) for s, c in zip(starts, counts)]
            for a in args
        ]
    elif in_order:
        split = [a.split(counts) for a in args]
    else:
        split = [a.index_select(0, routing.source_rows).split(counts) for a in args]
    outputs = [views.run(m, rows) for m, rows in zip(seg.members, zip(*split))]
    if in_order:
        joined = concat(outputs, seg.count_list)
        weights = routing.weights
        if weights is None:
            return joined
        return pytree.tree_map(
            lambda t: (
                t * weights.to(t.dtype).view(-1, *(1,) * (t.dim() - 1))
                if isinstance(t, torch.Tensor)
                else t
            ),
            joined,
        )
    return scatter(outputs, routing, seg)


def run_segments(plan: Plan, view: StackView, args: tuple[torch.Tensor, ...], seg: Segments) -> Any:
    """The plan once over all sorted rows, or (the cost rule ``per_segment``) once per
    segment on that segment's rows, the outputs joined in row order."""
    if not per_segment(len(seg.members), seg.rows):
        return run_plan(plan, view, args, seg)
    views: dict[int, Any] = {}
    outputs = []
    start = 0
    for m, count in zip(seg.members, seg.count_list):
        rows = tuple(a.narrow(0, start, count) for a in args)
        outputs.append(run_plan(plan, view, rows, Segments.one(m, count, seg.num_members, views)))
        start += count
    return concat(outputs, seg.count_list)


def blocked(
    view: StackView, gathered: tuple[Any, ...], kwargs: dict[str, Any], hooks: bool = True
) -> str | None:
    """Why the segment path does not apply to this call, or None; ``hooks=False`` leaves
    the hooks to the caller (``checked_plan``)."""
    if kwargs:
        return "keyword inputs (shared by every member) are not part of the segment path"
    if not all(isinstance(a, torch.Tensor) for a in gathered):
        return "a positional input is not a tensor"
    if hooks and hooked(view.module):
        return _HOOKED
    if compat.transforms_active() or compat.forward_ad_active():
        return "a torch.func transform or forward-mode AD is around the stack"
    device_type = gathered[0].device.type
    if device_type != "meta" and torch.is_autocast_enabled(device_type):  # meta: no autocast
        return "autocast is on"
    return None


def _warn_once(view: StackView, reason: str) -> None:
    cache = view.cache_of("routed")
    if cache.get("warned"):
        return
    cache["warned"] = True
    warn(
        f"phalanx: backend 'fused' runs routed calls (members=) member by member on their "
        f"own rows (exact, not batched): {reason}. The segment path runs members whose "
        f"forward is row-wise by construction (Linear layers, elementwise operations, "
        f"feature-dim cat/chunk/indexing/reductions); backend='auto' takes the same paths "
        f"without this warning.",
        FallbackWarning,
    )


def run_plan(plan: Plan, view: StackView, args: tuple[torch.Tensor, ...], seg: Segments) -> Any:
    live = view.module
    if plan.steps is None:
        plan.steps = _compile(plan, live)
    if len(args) > plan.placeholders:
        raise NotRowwise("more positional inputs than the traced forward takes")
    member_ids: set[int] | None = None
    env: list[Any] = []
    append = env.append
    fused: set[int] = set()  # the Linear steps whose activation ran inside them
    for step in plan.steps:
        op, target = step.op, step.target
        if op == "call_module":
            assert step.args is not None and step.kwargs is not None
            if step.activation is not None:  # a Linear, and the activation that follows it
                x = step.args(env)[0]
                if isinstance(x, RowTensor) and x.t.dim() >= 2:
                    weight, bias = target.weight, target.bias
                    y, done = segment_linear(x.t, weight, bias, seg, in_place(step.activation))
                    if done:
                        fused.add(len(env))
                    append(RowTensor(y))
                    continue
            append(call_module(target, step.args(env), step.kwargs(env), seg))
        elif op == "activation":
            assert step.args is not None and step.kwargs is not None
            if step.linear in fused:
                append(env[step.linear])
            else:
                append(call_module(target, step.args(env), step.kwargs(env), seg))
        elif op == "call_function" or op == "call_method":
            assert step.args is not None and step.kwargs is not None
            append(call_op(op, target, step.args(env), step.kwargs(env), seg))
        elif op == "placeholder":
            if target < len(args):
                append(RowTensor(args[target]))
            elif step.default is not _NO_DEFAULT:
                append(step.default)
            else:
                raise NotRowwise("a positional input is missing")
        elif op == "get_attr":
            if member_ids is None:
                member_ids = {id(t) for t in (*live.parameters(), *live.buffers())}
            append(_attr(live, plan.constants, target, member_ids))
        elif op == "output":
            assert step.args is not None
            out = step.args(env)
            for leaf in leaves(out):
                if isinstance(leaf, MemberTensor) or (
                    isinstance(leaf, torch.Tensor) and not isinstance(leaf, RowTensor)
                ):
                    raise NotRowwise("an output that is not made of the input rows")
                if isinstance(leaf, RowTensor) and (
                    leaf.t.dim() == 0 or leaf.t.shape[0] != seg.rows
                ):
                    raise NotRowwise("an output without one row per input row")
            return unwrap(out)
    raise NotRowwise("the trace has no output")


def _attr(live: nn.Module, constants: nn.Module, target: str, member_ids: set[int]) -> Any:
    value: Any = live
    try:
        for part in target.split("."):
            value = getattr(value, part)
    except AttributeError:
        value = constants
        for part in target.split("."):
            value = getattr(value, part)
        return value  # a tensor constant of the trace: the same for every member
    if isinstance(value, torch.Tensor):
        if id(value) not in member_ids:
            raise NotRowwise(f"the forward reads tensor attribute {target!r}")
        return MemberTensor(value)
    raise NotRowwise(f"the forward reads attribute {target!r}")
