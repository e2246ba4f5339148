"""The operations the segment path runs on rows: every function, method and module a row-wise
forward may call, each with the check that proves it row-wise (row r's result depends on row
r alone) and how it runs on all sorted rows at once.

To allow a new operation, add it here and nowhere else (docs/ARCHITECTURE.md, "Add a
row-wise op for routed members"): an elementwise function or method to
``_ELEMENTWISE_FUNCTIONS`` / ``_ELEMENTWISE_METHODS``; one along a dim to ``_DIM_FUNCTIONS`` /
``_DIM_METHODS``; an activation or dropout module to its tuple; anything with its own rule as a
handler called from ``call_op`` (functions and methods) or ``call_module`` (modules). An
operation not listed raises ``NotRowwise``, and the call takes the general path.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phalanx import _torch_compat as compat
from phalanx.routed._segments import NotRowwise, Segments, segment_linear


class RowTensor:
    """A row tensor: dim 0 holds the sorted rows."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class MemberTensor:
    """A member tensor: the stacked ``(N, *shape)`` parameter or buffer (or one derived from
    them by per-member operations)."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


_ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Softplus,
    nn.ELU, nn.CELU, nn.SELU, nn.Mish, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
    nn.Identity, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid, nn.Hardshrink, nn.Softshrink,
    nn.Threshold,
)  # fmt: skip
_DROPOUT_MODULES: tuple[type[nn.Module], ...] = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)  # fmt: skip

# Functions whose every output element depends on the same element of each input (after
# broadcasting): on rows, each row's result is the row's own.
_ELEMENTWISE_FUNCTIONS: set[Any] = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.pos, operator.abs, operator.eq,
    operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_,
    operator.or_, operator.invert,
    torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div, torch.divide,
    torch.true_divide, torch.pow, torch.neg, torch.abs, torch.exp, torch.exp2, torch.expm1,
    torch.log, torch.log1p, torch.log2, torch.log10, torch.sqrt, torch.rsqrt, torch.square,
    torch.sin, torch.cos, torch.tan, torch.tanh, torch.sigmoid, torch.relu, torch.erf,
    torch.erfc, torch.sign, torch.floor, torch.ceil, torch.round, torch.trunc, torch.clamp,
    torch.clip, torch.clamp_min, torch.clamp_max, torch.where, torch.maximum, torch.minimum,
    torch.reciprocal, torch.nan_to_num, torch.logaddexp, torch.atan2, torch.hypot,
    torch.asin, torch.acos, torch.atan, torch.sinh, torch.cosh, torch.lerp, torch.addcmul,
    torch.addcdiv, torch.fmod, torch.remainder, torch.logical_and, torch.logical_or,
    torch.logical_not, torch.isfinite, torch.isnan, torch.eq, torch.ne, torch.lt, torch.le,
    torch.gt, torch.ge,
    F.relu, F.relu6, F.silu, F.gelu, F.elu, F.selu, F.celu, F.leaky_relu, F.softplus,
    F.mish, F.hardtanh, F.hardswish, F.hardsigmoid, F.logsigmoid, F.softsign, F.tanhshrink,
    F.sigmoid, F.tanh, F.hardshrink, F.softshrink, F.threshold,
}  # fmt: skip
_ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "true_divide", "pow", "neg", "abs", "exp", "exp2", "expm1",
    "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "square", "sin", "cos", "tan", "tanh",
    "sigmoid", "relu", "erf", "sign", "floor", "ceil", "round", "trunc", "clamp", "clip",
    "clamp_min", "clamp_max", "reciprocal", "maximum", "minimum", "lerp", "nan_to_num",
    "float", "double", "half", "bfloat16", "to", "type_as", "contiguous", "clone",
    "__add__", "__sub__", "__mul__", "__truediv__", "__radd__", "__rsub__", "__rmul__",
    "__rtruediv__", "__neg__", "__pow__", "__rpow__", "eq", "ne", "lt", "le", "gt", "ge",
    "masked_fill", "logical_not", "isfinite", "isnan", "fmod", "remainder", "addcmul", "where",
}  # fmt: skip
# Operations along one dim (or a tuple of dims); on rows, row-wise when no dim is 0.
_DIM_FUNCTIONS: dict[Any, tuple[int, str, Any]] = {
    # function: (position of the dim argument, its name, its default)
    torch.softmax: (1, "dim", None),
    torch.log_softmax: (1, "dim", None),
    F.softmax: (1, "dim", None),
    F.log_softmax: (1, "dim", None),
    F.normalize: (2, "dim", 1),
    torch.sum: (1, "dim", None),
    torch.mean: (1, "dim", None),
    torch.amax: (1, "dim", None),
    torch.amin: (1, "dim", None),
    torch.prod: (1, "dim", None),
    torch.logsumexp: (1, "dim", None),
    torch.cumsum: (1, "dim", None),
    torch.cumprod: (1, "dim", None),
    torch.chunk: (2, "dim", 0),
    torch.split: (2, "dim", 0),
    torch.unbind: (1, "dim", 0),
    torch.flatten: (1, "start_dim", 0),
    torch.unsqueeze: (1, "dim", None),
    torch.squeeze: (1, "dim", None),
}
_DIM_METHODS: dict[str, tuple[int, str, Any]] = {
    "softmax": (1, "dim", None),
    "log_softmax": (1, "dim", None),
    "sum": (1, "dim", None),
    "mean": (1, "dim", None),
    "amax": (1, "dim", None),
    "amin": (1, "dim", None),
    "prod": (1, "dim", None),
    "logsumexp": (1, "dim", None),
    "cumsum": (1, "dim", None),
    "cumprod": (1, "dim", None),
    "chunk": (2, "dim", 0),
    "split": (2, "dim", 0),
    "unbind": (1, "dim", 0),
    "flatten": (1, "start_dim", 0),
    "unsqueeze": (1, "dim", None),
    "squeeze": (1, "dim", None),
}
_NEW_DIM = {torch.unsqueeze, "unsqueeze"}  # the dim counts in the result's rank
_CONSTRUCTORS = {
    torch.arange, torch.zeros, torch.ones, torch.full, torch.tensor, torch.linspace,
    torch.logspace, torch.eye, torch.as_tensor,
}  # fmt: skip
_CAT = {torch.cat, torch.concat, torch.concatenate, torch.stack}
_MATMUL = {operator.matmul, torch.matmul, torch.mm, "matmul", "mm", "__matmul__"}


def in_place(mod: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation module's own function, in place, with its settings read now."""
    kind = type(mod)
    if kind is nn.ReLU:
        return torch.relu_
    if kind is nn.SiLU:
        return lambda t: F.silu(t, inplace=True)
    if kind is nn.Tanh:
        return torch.tanh_
    if kind is nn.Sigmoid:
        return torch.sigmoid_
    assert isinstance(mod, nn.LeakyReLU)
    slope = mod.negative_slope
    return lambda t: F.leaky_relu_(t, slope)


IN_PLACE = (nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU)


def _dim(d: Any, rank: int) -> int:
    if not isinstance(d, int) or isinstance(d, bool):
        raise NotRowwise(f"a dim given as {type(d).__name__}")
    if not -rank <= d < rank:
        raise NotRowwise("a dim out of range")
    return d % rank


def map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` on every leaf of the tuples, lists, dicts and slices of an fx argument (a
    faster ``tree_map`` for the few containers a trace holds)."""
    if isinstance(value, (tuple, list)):
        return (
            type(value)(map_leaves(fn, v) for v in value)
            if type(value) in (tuple, list)
            else [map_leaves(fn, v) for v in value]
        )
    if isinstance(value, dict):
        return {k: map_leaves(fn, v) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(
            map_leaves(fn, value.start), map_leaves(fn, value.stop), map_leaves(fn, value.step)
        )
    return fn(value)


def leaves(value: Any, out: list[Any] | None = None) -> list[Any]:
    out = [] if out is None else out
    if isinstance(value, (tuple, list)):
        for v in value:
            leaves(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            leaves(v, out)
    elif isinstance(value, slice):
        leaves((value.start, value.stop, value.step), out)
    else:
        out.append(value)
    return out


def unwrap(value: Any) -> Any:
    return map_leaves(lambda v: v.t if isinstance(v, (RowTensor, MemberTensor)) else v, value)


def _check_rank(t: torch.Tensor, rank: int, what: str) -> None:
    """A constant (or a member's own tensor, without its member dim) that broadcasts against
    rows of ``rank`` dims without reaching the row dim."""
    if t.dim() > rank or (t.dim() == rank and t.shape[0] != 1):
        raise NotRowwise(f"{what} of shape {tuple(t.shape)} broadcasts over the rows")


def _elementwise(fn: Callable[..., Any], args: Any, kwargs: Any, seg: Segments) -> Any:
    found = leaves((args, kwargs))
    rows = [v for v in found if isinstance(v, RowTensor)]
    members = [v for v in found if isinstance(v, MemberTensor)]
    consts = [v for v in found if isinstance(v, torch.Tensor)]
    if not rows and not members:
        return fn(*args, **kwargs)
    if not rows:  # per-member tensors only: broadcast each after its member dim
        rank = max([m.t.dim() - 1 for m in members] + [c.dim() for c in consts])

        def lift(v: Any) -> Any:
            if isinstance(v, MemberTensor):
                return v.t.reshape(v.t.shape[0], *(1,) * (rank - v.t.dim() + 1), *v.t.shape[1:])
            return v

        a, k = map_leaves(lift, (args, kwargs))
        return MemberTensor(fn(*a, **k))
    rank = rows[0].t.dim()
    if rank == 0 or any(r.t.dim() != rank for r in rows):
        raise NotRowwise("an elementwise operation between row tensors of different ranks")
    for c in consts:
        _check_rank(c, rank, "a constant tensor")

    def per_row(v: Any) -> Any:
        if isinstance(v, RowTensor):
            return v.t
        if isinstance(v, MemberTensor):
            own = v.t.shape[1:]
            _check_rank(v.t[0], rank, "a member tensor")
            shape = own[1:] if len(own) == rank else (1,) * (rank - 1 - len(own)) + tuple(own)
            return v.t.reshape(v.t.shape[0], *shape).index_select(0, seg.member_of)
        return v

    a, k = map_leaves(per_row, (args, kwargs))
    out = fn(*a, **k)
    if not isinstance(out, torch.Tensor) or out.dim() != rank or out.shape[0] != seg.rows:
        raise NotRowwise("an elementwise operation that changed the rows")
    return RowTensor(out)


def call_module(mod: nn.Module, args: Any, kwargs: Any, seg: Segments) -> Any:
    kind = type(mod)
    x = args[0] if args else None
    if kind is nn.Linear:
        if len(args) != 1 or kwargs or not isinstance(x, RowTensor):
            raise NotRowwise("a Linear layer on something other than the rows")
        if x.t.dim() < 2:
            raise NotRowwise("a Linear layer on rows without a feature dim")
        weight, bias = mod.weight, mod.bias
        assert isinstance(weight, torch.Tensor)
        return RowTensor(
            segment_linear(x.t, weight, bias if isinstance(bias, torch.Tensor) else None, seg)[0]
        )
    if compat.own_parameters(mod) or compat.own_buffers(mod):
        raise NotRowwise(f"a {kind.__name__} layer")
    if kind in _DROPOUT_MODULES:
        if mod.training and getattr(mod, "p", 0) > 0:
            raise NotRowwise("dropout draws its masks per member in the loop")
        return x
    if kind in _ACTIVATION_MODULES:
        return _elementwise(mod, args, kwargs, seg)
    if kind is nn.Flatten and isinstance(x, RowTensor):
        if _dim(mod.start_dim, x.t.dim()) == 0:
            raise NotRowwise("Flatten over the rows")
        return RowTensor(mod(x.t))
    if kind in (nn.Softmax, nn.LogSoftmax, nn.Softmin) and isinstance(x, RowTensor):
        if mod.dim is None or _dim(mod.dim, x.t.dim()) == 0:
            raise NotRowwise(f"{kind.__name__} over the rows")
        return RowTensor(mod(x.t))
    raise NotRowwise(f"a {kind.__name__} layer")


def call_op(op: str, target: Any, args: Any, kwargs: Any, seg: Segments) -> Any:
    found = leaves((args, kwargs))
    if not any(
        isinstance(v, (RowTensor, MemberTensor)) for v in found
    ):  # constants only: run as written
        if op == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        return target(*args, **kwargs)
    name = target if op == "call_method" else getattr(target, "__name__", repr(target))
    if target is operator.getitem:
        return _getitem(args[0], args[1])
    if target is getattr:
        obj, attr = args[0], args[1]
        if attr in ("device", "dtype", "is_cuda", "is_floating_point"):
            return getattr(obj.t, attr)
        if attr == "ndim" and isinstance(obj, RowTensor):
            return obj.t.dim()
        raise NotRowwise(f"the forward reads .{attr} of a tensor")
    if target in _MATMUL or target is F.linear:
        return _matmul(target, args, kwargs, seg)
    if op == "call_method":
        if target in ("dim", "size"):
            return _size(target, args, kwargs)
        if target in _ELEMENTWISE_METHODS:
            return _elementwise(lambda s, *a, **k: getattr(s, target)(*a, **k), args, kwargs, seg)
        if target in _DIM_METHODS:
            return _dimwise(target, lambda s, *a, **k: getattr(s, target)(*a, **k), args, kwargs)
        if target in ("transpose", "swapaxes", "permute"):
            return _transpose(target, args)
        raise NotRowwise(f"the method .{name}()")
    if target in _ELEMENTWISE_FUNCTIONS:
        return _elementwise(target, args, kwargs, seg)
    if target in _DIM_FUNCTIONS:
        return _dimwise(target, target, args, kwargs)
    if target in _CAT:
        return _cat(target, args, kwargs)
    if target in (torch.transpose, torch.swapaxes, torch.permute):
        return _transpose(target, args)
    raise NotRowwise(f"the function {name}")


def _size(target: str, args: Any, kwargs: Any) -> Any:
    obj = args[0]
    if not isinstance(obj, RowTensor):
        raise NotRowwise(f".{target}() of a member tensor")
    if target == "dim":
        return obj.t.dim()
    d = args[1] if len(args) > 1 else kwargs.get("dim")
    if d is None or _dim(d, obj.t.dim()) == 0:
        raise NotRowwise("the forward reads the number of rows")
    return obj.t.size(d)


def _getitem(obj: Any, index: Any) -> Any:
    if isinstance(obj, (tuple, list)):
        if not isinstance(index, (int, slice)):
            raise NotRowwise("a sequence indexed by a tensor")
        return obj[index]
    if isinstance(obj, MemberTensor):
        if any(isinstance(i, (torch.Tensor, RowTensor, MemberTensor)) for i in leaves(index)):
            raise NotRowwise("a member tensor indexed by a tensor")
        rest = index if isinstance(index, tuple) else (index,)
        return MemberTensor(obj.t[(slice(None), *rest)])
    if not isinstance(obj, RowTensor):
        raise NotRowwise("indexing")
    idx = index if isinstance(index, tuple) else (index,)
    for i in idx:
        if not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool):
            raise NotRowwise("rows indexed by a tensor")
    rank = obj.t.dim()
    if idx and isinstance(idx[0], slice) and idx[0] == slice(None):
        pass  # every row kept, in order
    elif idx and idx[0] is Ellipsis:
        rest = idx[1:]
        if Ellipsis in rest or sum(i is not None for i in rest) > rank - 1:
            raise NotRowwise("an index over the rows")
    else:
        raise NotRowwise("an index over the rows")
    return RowTensor(obj.t[index])


def _dimwise(key: Any, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    position, name, default = (_DIM_METHODS if isinstance(key, str) else _DIM_FUNCTIONS)[key]
    obj = args[0]
    if not isinstance(obj, RowTensor) or any(
        isinstance(v, (RowTensor, MemberTensor)) for v in leaves((args[1:], kwargs))
    ):
        raise NotRowwise(f"{getattr(key, '__name__', key)} on a member tensor")
    d = args[position] if len(args) > position else kwargs.get(name, default)
    if d is None:
        raise NotRowwise(f"{getattr(key, '__name__', key)} over every dim, the rows included")
    rank = obj.t.dim() + (1 if key in _NEW_DIM else 0)
    dims = d if isinstance(d, (tuple, list)) else (d,)
    if any(_dim(x, rank) == 0 for x in dims):
        raise NotRowwise(f"{getattr(key, '__name__', key)} over the rows")
    if key in (torch.flatten, "flatten"):
        end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
        _dim(end, rank)
    out = fn(obj.t, *args[1:], **kwargs)
    if isinstance(out, torch.Tensor):
        return RowTensor(out)
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return tuple(RowTensor(o) for o in out)
    raise NotRowwise(f"{getattr(key, '__name__', key)} returned {type(out).__name__}")


def _transpose(key: Any, args: Any) -> Any:
    obj = args[0]
    if not isinstance(obj, RowTensor):
        raise NotRowwise("a transpose of a member tensor")
    rank = obj.t.dim()
    if key in ("permute", torch.permute):
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        if _dim(dims[0], rank) != 0:
            raise NotRowwise("a permute that moves the rows")
        return RowTensor(obj.t.permute(*dims))
    d0, d1 = args[1], args[2]
    if _dim(d0, rank) == 0 or _dim(d1, rank) == 0:
        raise NotRowwise("a transpose that moves the rows")
    return RowTensor(obj.t.transpose(d0, d1))


def _cat(key: Any, args: Any, kwargs: Any) -> Any:
    tensors = args[0]
    d = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, (tuple, list)) or not tensors:
        raise NotRowwise("torch.cat of something other than a sequence")
    if not all(isinstance(t, RowTensor) for t in tensors):
        raise NotRowwise("torch.cat mixing rows with other tensors")
    rank = tensors[0].t.dim()
    if any(t.t.dim() != rank for t in tensors):
        raise NotRowwise("torch.cat of row tensors of different ranks")
    if _dim(d, rank + (1 if key is torch.stack else 0)) == 0:
        raise NotRowwise("torch.cat along the rows")
    return RowTensor(key([t.t for t in tensors], d))


def _matmul(target: Any, args: Any, kwargs: Any, seg: Segments) -> Any:
    if target is F.linear:
        x = args[0]
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        if not isinstance(x, RowTensor) or x.t.dim() < 2:
            raise NotRowwise("F.linear on something other than the rows")
        if isinstance(w, MemberTensor) and (b is None or isinstance(b, MemberTensor)):
            if w.t.dim() != 3 or (b is not None and b.t.dim() != 2):
                raise NotRowwise("F.linear with a weight that is not a matrix")
            return RowTensor(segment_linear(x.t, w.t, None if b is None else b.t, seg)[0])
        if isinstance(w, torch.Tensor) and not isinstance(b, (RowTensor, MemberTensor)):
            return RowTensor(F.linear(x.t, w, b))
        raise NotRowwise("F.linear mixing member and shared tensors")
    if kwargs or len(args) != 2:
        raise NotRowwise("a matmul")
    a, b = args
    if not isinstance(a, RowTensor) or a.t.dim() < 2:
        raise NotRowwise("a matmul whose left operand is not the rows")
    if isinstance(b, MemberTensor) and b.t.dim() == 3:
        return RowTensor(segment_linear(a.t, b.t.transpose(1, 2), None, seg)[0])
    if (
        isinstance(b, torch.Tensor)
        and not isinstance(b, (RowTensor, MemberTensor))
        and b.dim() == 2
    ):
        return RowTensor(a.t @ b)
    raise NotRowwise("a matmul with a right operand that is not a matrix")


# ------------------------------------------------------------------------------------ subsets
