"""A member's own forward as one generated Python function: the per-segment runs of the cost
rule (one member on its own rows) and the per-member runs of ``subset=``.

The trace of the member's forward (``_rowwise.Plan``) is rewritten once into a ``torch.fx``
graph whose inputs are the forward's own inputs and member m's tensors: each ``nn.Linear``
becomes ``F.linear`` on member m's weight and bias, each read of a member parameter or
buffer member m's slice of the stacked tensor, parameterless modules (activations) stay
calls of the live modules, every other node is copied as it is. fx generates the Python
code of that graph, so a run costs what the member's own ``forward`` costs, without the
interpretation of ``_rowwise.run_plan`` (which proves each operation row-wise and runs it on
the rows of every member at once). The operations are the member's own, in its order, so
the result is bit for bit the member's forward on those rows.

Where no autograd graph is recorded, a second variant runs an activation or an elementwise
product, sum or difference in place on a temporary that nothing else reads (the output of a
Linear or of another such operation, with one user), with the same values: in place only
where the result keeps the temporary's shape and dtype, checked at run time.

A forward with a module this rewrite does not know (a leaf module with parameters or buffers
other than ``nn.Linear``) has no direct function (``compile_direct`` returns None) and keeps
``run_plan``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from phalanx import _torch_compat as compat
from phalanx.routed._rowwise_ops import IN_PLACE, in_place


class Direct:
    """A member's forward as ``fn(tensors, *inputs)`` (``fn(tensors, buffers, *inputs)`` for
    the in-place variant), ``tensors`` member m's tensors.

    Attributes:
        sources: where each tensor comes from on every call: ``(module, name)`` of a
            stacked ``(N, ...)`` tensor of the live module (member m's slice is passed), or
            ``(None, tensor)`` for a constant the trace recorded (passed as it is).
        graph_fn: the function for calls that record an autograd graph.
        inplace_fn: the function with the in-place variants, for calls that do not.
        writes: whether the forward itself may write a tensor in place (an in-place method,
            ``inplace=True``): then its inputs must be copies of the caller's rows, never
            views of them.
        workspace: the in-place variant's reused Linear outputs (``Workspace``), held here so
            that a copy of the stack (``copy.deepcopy``) holds its own.
    """

    def __init__(
        self,
        sources: list[tuple[nn.Module | None, Any]],
        graph_fn: Callable[..., Any],
        inplace_fn: Callable[..., Any],
        writes: bool,
    ) -> None:
        self.sources, self.graph_fn, self.inplace_fn = sources, graph_fn, inplace_fn
        self.writes = writes
        self.workspace = Workspace()
        self._views: dict[bool, dict[int, list[torch.Tensor]]] = {}
        self._stamp: tuple[Any, ...] | None = None
        self._objects: list[torch.Tensor] | None = None

    def stacked(self) -> list[tuple[bool, torch.Tensor]]:
        """The tensors of this call: per source, (whether it is a stacked member tensor, it),
        read from the module's own parameters and buffers as ``getattr`` finds them."""
        out: list[tuple[bool, torch.Tensor]] = []
        for mod, name in self.sources:
            if mod is None:
                out.append((False, name))
                continue
            t = compat.own_parameters(mod).get(name)
            if t is None:
                t = compat.own_buffers(mod).get(name)
                if t is None:
                    t = getattr(mod, name)  # anything else getattr answers (a property)
            out.append((True, t))
        return out

    def views_of(self, tensors: list[tuple[bool, torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        """Member by member, the slices of ``tensors`` (this call's ``stacked()``) for calls
        that record no autograd graph, each made once (``MemberViews.of``) and kept while
        every stacked tensor is the same object over the same memory (``compat.memory_stamp``
        unchanged): a tensor replaced (``module.weight = ...``), given new
        memory (``.data = ...``, ``Module.to``, ``set_``, ``swap_tensors``) or reshaped makes
        them afresh. Values changed in place (an optimizer step, ``copy_``,
        ``load_state_dict``) need nothing: the slices are views. Slices made in inference
        mode are kept apart from the others."""
        stamp = tuple(compat.memory_stamp(t) for member, t in tensors if member)
        objects = self._objects
        if (
            stamp != self._stamp
            or objects is None
            or len(objects) != len(tensors)
            or not all(a is b for a, (_, b) in zip(objects, tensors))
        ):
            self._views = {}
            self._stamp, self._objects = stamp, [t for _, t in tensors]
        return self._views.setdefault(torch.is_inference_mode_enabled(), {})


class MemberViews:
    """Member m's slices of a call's tensors, for the members ``members`` that the call runs.

    Where an autograd graph is recorded, the stacked tensors that require grad are split
    once per call, so that backward writes the members' gradients into the stacked gradients
    in one pass: ``unbind`` when the call runs every member (its backward stacks them), else
    one ``_MemberSlices`` over all of them (per tensor one stack of the members' gradients
    and zero slices), instead of one zero-filled full-size gradient per slice, or one per
    member left out. Where none is recorded, member m's slices are the ones
    ``Direct.member_views`` keeps between calls.
    """

    def __init__(self, direct: Direct, members: list[int], num_members: int) -> None:
        self.graph = torch.is_grad_enabled()
        self._direct = direct
        self._tensors = direct.stacked()
        self._members = members
        self._every = len(members) == num_members
        self._split: dict[int, dict[int, torch.Tensor]] | None = None
        self.fn = direct.graph_fn if self.graph else direct.inplace_fn
        self._kept = None if self.graph else direct.views_of(self._tensors)

    def _split_all(self) -> dict[int, dict[int, torch.Tensor]]:
        graded = [i for i, (member, t) in enumerate(self._tensors) if member and t.requires_grad]
        split: dict[int, dict[int, torch.Tensor]] = {}
        if self._every:
            for i in graded:
                t = self._tensors[i][1]
                split[i] = dict(enumerate(t.unbind(0)))
        elif graded:
            members = self._members
            flat = _MemberSlices.apply(members, *(self._tensors[i][1] for i in graded))
            k = len(members)
            for j, i in enumerate(graded):
                split[i] = dict(zip(members, flat[j * k : (j + 1) * k]))
        return split

    def of(self, m: int) -> list[torch.Tensor]:
        kept = self._kept
        if kept is not None:
            views = kept.get(m)
            if views is None:
                views = kept[m] = [t[m] if member else t for member, t in self._tensors]
            return views
        if self._split is None:
            self._split = self._split_all()
        split = self._split
        return [
            split[i][m] if i in split else (t[m] if member else t)
            for i, (member, t) in enumerate(self._tensors)
        ]

    def run(self, m: int, inputs: tuple[Any, ...]) -> Any:
        if self._kept is None:
            return self.fn(self.of(m), *inputs)
        return self.fn(self.of(m), self._direct.workspace.buffers, *inputs)


class _MemberSlices(torch.autograd.Function):
    """``t[m] for m in members`` for each of the tensors ``ts`` (flat, tensor by tensor), whose
    backward stacks, per tensor, its members' gradients and one zero slice for every member
    left out (``unbind``'s backward would allocate a zero slice for each), one autograd node
    for all the tensors of a call."""

    @staticmethod
    def forward(ctx: Any, members: Any, *ts: torch.Tensor) -> Any:
        ctx.members, ctx.shapes = list(members), [t.shape for t in ts]
        ctx.set_materialize_grads(False)  # members' slices that no output reads stay None
        return tuple(t[m] for t in ts for m in ctx.members)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        k = len(ctx.members)
        out: list[torch.Tensor | None] = [None]
        for j, shape in enumerate(ctx.shapes):
            own = grads[j * k : (j + 1) * k]
            first = next((g for g in own if g is not None), None)
            if first is None:
                out.append(None)
                continue
            zero = first.new_zeros(first.shape)  # one member's slice, read for each other
            parts = [zero] * shape[0]
            for m, g in zip(ctx.members, own):
                if g is not None:
                    parts[m] = g
            out.append(torch.stack(parts))  # each byte written once (no fill, then copies)
        return tuple(out)


# -------------------------------------------------------------------------- in-place variants

_UNARY_IN_PLACE: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {
    torch.relu: torch.relu_,
    F.relu: torch.relu_,
    torch.tanh: torch.tanh_,
    F.tanh: torch.tanh_,
    torch.sigmoid: torch.sigmoid_,
    F.sigmoid: torch.sigmoid_,
    F.silu: lambda t: F.silu(t, inplace=True),
    torch.exp: torch.exp_,
}
_BINARY_IN_PLACE: dict[Any, str] = {
    operator.mul: "mul_",
    torch.mul: "mul_",
    operator.add: "add_",
    torch.add: "add_",
    operator.sub: "sub_",
    torch.sub: "sub_",
    operator.truediv: "div_",
    torch.div: "div_",
}
_FRESH_FUNCTIONS = {*_BINARY_IN_PLACE, F.linear, F.softplus, torch.cat}
"""Functions whose result is a new tensor (never a view of an argument, never an argument)
unless given ``out=``; the unary ones of ``_UNARY_IN_PLACE`` are new with one argument and no
keywords (no ``inplace=True``)."""


def _unary(node: fx.Node) -> bool:
    """``node`` is an out-of-place call of a function of ``_UNARY_IN_PLACE`` on one tensor:
    ``f(x)``, ``f(x, False)`` or ``f(x, inplace=False)`` (how fx records ``F.relu(x)``)."""
    if node.target not in _UNARY_IN_PLACE:
        return False
    args, kwargs = node.args, node.kwargs
    return (len(args) == 1 or (len(args) == 2 and args[1] is False)) and (
        not kwargs or (len(args) == 1 and dict(kwargs) == {"inplace": False})
    )


def _fresh(node: fx.Node) -> bool:
    """Whether the call ``node`` returns a new tensor."""
    if node.target in _UNARY_IN_PLACE:
        return _unary(node)
    return node.target in _FRESH_FUNCTIONS and "out" not in node.kwargs


def _binary_into(method: str) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """``a <op> b`` written into ``a`` where the result has ``a``'s shape and dtype, else
    computed out of place: the same values either way."""

    def run(a: torch.Tensor, b: Any) -> torch.Tensor:
        if isinstance(b, torch.Tensor):
            fits = _broadcasts_to(b.shape, a.shape)
        else:
            fits = isinstance(b, (int, float)) and not isinstance(b, bool)
        if fits and torch.result_type(a, b) == a.dtype:
            return getattr(a, method)(b)
        return getattr(torch.Tensor, method.rstrip("_"))(a, b)

    run.__name__ = f"phalanx_{method}into"
    return run


def _broadcasts_to(small: torch.Size, big: torch.Size) -> bool:
    """Whether ``small`` broadcasts to ``big`` itself (``torch.broadcast_shapes(big, small) ==
    big``, which measured 27 us a call against 1 us for this comparison: once per segment and
    in-place operation)."""
    lead = len(big) - len(small)
    return lead >= 0 and all(s == 1 or s == b for s, b in zip(small, big[lead:]))


_BINARY_INTO = {method: _binary_into(method) for method in set(_BINARY_IN_PLACE.values())}


def _activation_in_place(mod: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(t: torch.Tensor) -> torch.Tensor:
        return in_place(mod)(t)  # the module's settings read on every call

    run.__name__ = f"phalanx_{type(mod).__name__.lower()}_in_place"
    _IN_PLACE_TARGETS.add(run)
    return run


_IN_PLACE_TARGETS: Any = {*_UNARY_IN_PLACE.values(), *_BINARY_INTO.values()}
"""The in-place targets of the rewrite (the activation modules' are added as they are made;
a weak set would do, but these functions live as long as their plans)."""


class Workspace:
    """Where no autograd graph is recorded, the output buffers of the Linear layers whose
    output lives only inside the forward (read by one operation whose result is new, or
    through in-place operations whose result is): one ``(rows, out)`` buffer per such
    Linear, grown to the most rows seen and reused by every segment and every call, instead
    of a new allocation (and, above the allocator's threshold, fresh pages) each time. The
    values are ``F.linear``'s (``addmm``/``mm`` into the buffer, the kernels it calls for
    a 2-D input). No buffer is ever a forward's output nor read by one (the Linears chosen
    by ``_internal_linears``), so a result the caller keeps never changes on the next call.
    The buffers are passed to the generated function on each call (``Direct.workspace``), so
    a copy of the stack has its own; the stack's lock keeps two calls from sharing them at
    once. Buffers made in inference mode (inference tensors, which no call outside it may
    write) are kept apart from the others."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> Workspace:
        return Workspace()  # scratch: a copy starts empty rather than copying the buffers


WORKSPACE_MIN = 8192
"""Outputs of fewer elements than this (32 KiB in float32, well below the allocator's
threshold for fresh pages) are ``F.linear``'s own: a new small tensor costs less than the
buffer's bookkeeping (a PETS call of 400 rows on 5 members: 80-row segments, 64 features)."""


def phalanx_linear_into(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    slot: int,
    buffers: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """``F.linear(x, w, b)`` written into the reused buffer ``buffers[slot]`` (a
    ``Workspace``'s), or ``F.linear`` itself where its input is not a 2-D matrix of the
    weight's dtype or the output is small (``WORKSPACE_MIN``)."""
    if (
        x.dim() != 2
        or w.dim() != 2
        or x.shape[0] * w.shape[0] < WORKSPACE_MIN
        or w.dtype != x.dtype
        or (b is not None and (b.dim() != 1 or b.dtype != x.dtype))
    ):
        return F.linear(x, w, b)  # F.linear's own broadcasting, promotion, errors
    rows, out_f = x.shape[0], w.shape[0]
    key = (slot, torch.is_inference_mode_enabled())
    entry = buffers.get(key)  # (the buffer, its rows of the last call: a slice costs 2 us)
    if entry is None or entry[0].dtype != x.dtype or entry[0].device != x.device:
        entry = None
    else:
        buf, y = entry
        if y.shape[0] != rows or buf.shape[1] != out_f:
            if buf.shape[0] < rows or buf.shape[1] != out_f:
                entry = None
            else:
                entry = buffers[key] = (buf, buf if buf.shape[0] == rows else buf[:rows])
    if entry is None:
        buf = x.new_empty(rows, out_f)
        entry = buffers[key] = (buf, buf)
    y = entry[1]
    if b is None:
        return torch.mm(x, w.t(), out=y)
    return torch.addmm(b, x, w.t(), out=y)


def _internal_linears(graph: fx.Graph) -> list[fx.Node]:
    """The ``F.linear`` nodes of the rewritten in-place graph whose output lives only inside
    the forward: it, or the in-place chain that writes it, has one user whose result is a
    new tensor not written into it (see ``Workspace``)."""
    found = []
    for node in graph.nodes:
        if (
            node.op != "call_function"
            or node.target is not F.linear
            or len(node.args) != 3
            or node.kwargs
        ):
            continue
        cur = node
        while True:
            if len(cur.users) != 1:
                break
            (user,) = cur.users
            if user.op != "call_function":
                break
            if user.target in _IN_PLACE_TARGETS and user.args and user.args[0] is cur:
                cur = user  # written in place (or, at run time, a new tensor): follow it
                continue
            if user.target in _IN_PLACE_TARGETS or _fresh(user):
                found.append(node)  # read by an operation whose result is a new tensor
            break
    return found


# ---------------------------------------------------------------------------------- the rewrite


def compile_direct(graph: fx.Graph, live: nn.Module, constants: nn.Module) -> Direct | None:
    """The trace ``graph`` of ``live``'s forward as a ``Direct``, or None where a node is a
    module call this rewrite does not know."""
    member_ids = {id(t) for t in (*live.parameters(), *live.buffers())}
    built = [_rewrite(graph, live, constants, member_ids, inplace) for inplace in (False, True)]
    if built[0] is None or built[1] is None:
        return None
    (sources, graph_fn), (_, inplace_fn) = built[0], built[1]
    return Direct(sources, graph_fn, inplace_fn, _writes(graph, live))


def _writes(graph: fx.Graph, live: nn.Module) -> bool:
    """Whether a node of the trace may write a tensor in place."""
    for node in graph.nodes:
        if node.op == "call_module" and getattr(live.get_submodule(node.target), "inplace", False):
            return True
        if node.op in ("call_function", "call_method") and (
            node.kwargs.get("inplace") or "out" in node.kwargs
        ):
            return True
        if (
            node.op == "call_function"
            and node.target in _UNARY_IN_PLACE
            and len(node.args) > 1
            and node.args[1] is not False
        ):
            return True  # F.relu(x, True)
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if isinstance(name, str) and name.endswith("_") and not name.endswith("__"):
            return True
    return False


def _rewrite(
    graph: fx.Graph, live: nn.Module, constants: nn.Module, member_ids: set[int], inplace: bool
) -> tuple[list[tuple[nn.Module | None, Any]], Callable[..., Any]] | None:
    new = fx.Graph()
    tensors = new.placeholder("phalanx_tensors")
    sources: list[tuple[nn.Module | None, Any]] = []
    slots: dict[tuple[int, Any], fx.Node] = {}
    env: dict[fx.Node, Any] = {}
    fresh: set[fx.Node] = set()  # new nodes whose value is a temporary no other node reads
    holder = nn.Module()  # the live parameterless modules the code calls
    users = {n: len(n.users) for n in graph.nodes}

    def tensor(mod: nn.Module | None, name: Any) -> fx.Node:
        key = (id(mod), name if mod is not None else id(name))
        if key not in slots:
            sources.append((mod, name))
            slots[key] = new.call_function(operator.getitem, (tensors, len(sources) - 1))
        return slots[key]

    def lookup(target: str) -> tuple[nn.Module | None, Any] | None:
        owner_path, _, name = target.rpartition(".")
        try:
            owner = live.get_submodule(owner_path)
            value = getattr(owner, name)
        except AttributeError:
            value = constants
            for part in target.split("."):
                value = getattr(value, part)
            return (None, value) if isinstance(value, torch.Tensor) else None
        if isinstance(value, torch.Tensor) and id(value) in member_ids:
            return owner, name
        return None

    def single_use(arg: Any, node: fx.Node) -> bool:
        return isinstance(arg, fx.Node) and users[arg] == 1 and env[arg] in fresh

    for node in graph.nodes:
        load = lambda v: env[v]  # noqa: E731
        if node.op == "placeholder":
            env[node] = new.node_copy(node, load)
        elif node.op == "get_attr":
            found = lookup(node.target)
            if found is None:
                return None
            env[node] = tensor(*found)
        elif node.op == "call_module":
            mod = live.get_submodule(node.target)
            if type(mod) is nn.Linear:
                if len(node.args) != 1 or node.kwargs:
                    return None
                b = tensor(mod, "bias") if isinstance(mod.bias, torch.Tensor) else None
                out = new.call_function(F.linear, (env[node.args[0]], tensor(mod, "weight"), b))
                fresh.add(out)
            elif (
                compat.own_parameters(mod)
                or compat.own_buffers(mod)
                or any(True for _ in mod.children())
            ):
                return None
            elif (
                inplace
                and type(mod) in IN_PLACE
                and len(node.args) == 1
                and not node.kwargs
                and single_use(node.args[0], node)
            ):
                out = new.call_function(_activation_in_place(mod), (env[node.args[0]],))
                fresh.add(out)
            else:
                name = f"m{sum(1 for _ in holder.children())}"
                holder.add_module(name, mod)
                out = new.call_module(name, *fx.node.map_arg((node.args, node.kwargs), load))
                if type(mod) in IN_PLACE and not getattr(mod, "inplace", False):
                    fresh.add(out)
            env[node] = out
        elif node.op == "call_function":
            target = node.target
            first = node.args[0] if node.args else None
            if inplace and _unary(node) and single_use(first, node):
                assert isinstance(first, fx.Node)
                out = new.call_function(_UNARY_IN_PLACE[target], (env[first],))
            elif (
                inplace
                and target in _BINARY_IN_PLACE
                and len(node.args) == 2
                and not node.kwargs
                and single_use(first, node)
                and node.args[1] is not first
            ):
                into = _BINARY_INTO[_BINARY_IN_PLACE[target]]
                out = new.call_function(into, fx.node.map_arg(node.args, load))
            else:
                out = new.node_copy(node, load)
            if _fresh(node):
                fresh.add(out)
            env[node] = out
        elif node.op == "call_method":
            env[node] = new.node_copy(node, load)
        elif node.op == "output":
            new.output(fx.node.map_arg(node.args[0], load))
    if inplace:
        with new.inserting_after(tensors):
            buffers = new.placeholder("phalanx_buffers")  # the Workspace's, on every call
        for slot, node in enumerate(_internal_linears(new)):
            node.target = phalanx_linear_into
            node.args = (*node.args, slot, buffers)
    code = fx.GraphModule(holder, new)
    return sources, code.forward
