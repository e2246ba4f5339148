"""The fused backend: the member's own ``forward`` runs once, on a folded batch.

Inputs are folded to ``(N * B, ...)`` (member i's samples in rows ``i * B .. i * B + B``), so
the member's own per-sample code is correct as written; a copy of the member's module tree
has every layer that holds stacked tensors swapped for its batched version
(``_fused_layers``, ``_fused_mlp``), and outputs are unfolded to ``(N, B, ...)``.

What a forward does across the batch (a mean over dim 0, ``x[0]``, a reshape that mixes
samples) the batched layers cannot honour, and it would give a silently wrong answer. So the
fused result is checked against the reference (vmap, or the loop where vmap cannot run) on
the real input, once for every case the forward can branch on that phalanx can see: the
input's shapes, dtypes and devices, which inputs are per-member, every submodule's
train/eval mode, grad mode and autocast. A case not yet checked is checked before it is
trusted, however many there are. Random draws (dropout, ``randn_like``) are replaced by
constants in both runs of the check, and buffers and RNG states are restored after it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from phalanx._backends import BackendRefusal
from phalanx._backends._fused_layers import classify, fold_sizes, folding
from phalanx._backends._fused_mlp import BatchedMLP, mlp_layers
from phalanx._backends._preserve import preserved
from phalanx._modules import copy_modes

if TYPE_CHECKING:
    from phalanx._backends import StackView


def build_tree(view: StackView) -> nn.Module:
    """The member's module tree with batched layers, reading the stack's tensors."""
    tree = copy.deepcopy(view.template)
    n = view.num_members
    replaced: list[str] = []
    for path, sub in list(tree.named_modules()):
        if any(path.startswith(p + ".") or p == "" for p in replaced):
            continue
        kind, factory = ("batched", BatchedMLP) if mlp_layers(sub) else classify(sub)
        if kind == "batched" and factory is not None:
            batched = factory(view.module.get_submodule(path), n)
            replaced.append(path)
            if path == "":
                tree = batched
            else:
                parent, _, leaf = path.rpartition(".")
                setattr(tree.get_submodule(parent), leaf, batched)
    return tree


def fused_tree(view: StackView) -> nn.Module:
    cache = view.cache_of("fused")
    if "tree" not in cache:
        cache["tree"] = build_tree(view)
        cache["checked"] = set()
        cache["modes"] = None
    return cache["tree"]


def _modes(cache: dict[str, Any], module: nn.Module) -> tuple[bool, ...]:
    modules = cache.get("modules")
    if modules is None:  # the tree's structure is fixed; only the modes change
        modules = cache["modules"] = list(module.modules())
    return tuple(m.training for m in modules)


def _sig(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (a.shape, a.dtype, a.device, a.requires_grad)
    return (type(a), a) if isinstance(a, (bool, int, float, str, type(None))) else type(a)


def _case(args: tuple, kwargs: dict, in_dims: tuple, modes: tuple) -> tuple:
    """Everything the member's forward can branch on that phalanx can see."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    autocast = torch.is_autocast_enabled(device)
    return (
        tuple(map(_sig, args)),
        in_dims,
        tuple(sorted((k, _sig(v)) for k, v in kwargs.items())) if kwargs else (),
        modes,
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.get_autocast_dtype(device) if autocast else None,
    )


_NO_DROPOUT = {
    F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d,
    torch.dropout, torch.alpha_dropout, torch.feature_alpha_dropout,
}  # fmt: skip
_CONSTANT_DRAWS = {torch.randn_like, torch.rand_like, torch.normal, torch.bernoulli}


class _Deterministic(TorchFunctionMode):
    """Dropout off and random draws replaced by a constant, in both runs of the check.

    Members draw their own randomness, so no two backends can draw the same numbers; with
    the draws pinned the check compares everything else the forward does.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _NO_DROPOUT:
            return args[0] if args else kwargs["input"]
        if func in _CONSTANT_DRAWS:
            like = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if like is not None:
                return torch.full_like(like, 0.5, dtype=kwargs.get("dtype") or like.dtype)
        if func is F.scaled_dot_product_attention and kwargs.get("dropout_p", 0.0):
            kwargs = {**kwargs, "dropout_p": 0.0}
        if func is F.scaled_dot_product_attention and len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        return func(*args, **kwargs)


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 2e-2
    if dtype == torch.float64:
        return 1e-9, 1e-9
    return 1e-4, 1e-5


def _compare(got: Any, expected: Any, loose: int = 1) -> str | None:
    g_flat, g_spec = pytree.tree_flatten(got)
    e_flat, e_spec = pytree.tree_flatten(expected)
    if g_spec != e_spec:
        return f"the output structure differs ({g_spec} against {e_spec})"
    for k, (g, e) in enumerate(zip(g_flat, e_flat)):
        if not isinstance(e, torch.Tensor):
            if g != e:
                return f"output {k} is {g!r}, the reference's {e!r}"
            continue
        if not isinstance(g, torch.Tensor) or g.shape != e.shape:
            shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            return f"output {k} has shape {shape}, the reference {tuple(e.shape)}"
        if not e.is_floating_point():
            if not torch.equal(g, e):
                return f"output {k} differs from the reference"
            continue
        # Under autocast one side may have computed in lower precision than the other.
        rtol, atol = (loose * t for t in max(_tolerance(e.dtype), _tolerance(g.dtype)))
        wide = torch.promote_types(g.dtype, e.dtype)
        g, e = g.detach().to(wide), e.detach().to(wide)
        finite = e[torch.isfinite(e)]  # a diverged member's NaNs must not poison the scale
        scale = 1.0 + finite.abs().max().item() if finite.numel() else 1.0
        # allclose with equal_nan counts NaN == NaN and equal infinities as agreeing.
        if not torch.allclose(g, e, rtol=rtol, atol=atol * scale, equal_nan=True):
            err = (g - e).abs().max().item()
            return f"output {k} differs from the reference by up to {err:.3g}"
    return None


def _param_grads(view: StackView, out: Any) -> list[torch.Tensor] | None:
    """The parameters' gradients of ``out`` under a fixed random cotangent, or None when
    there is nothing to differentiate. Taken right after the forward, before buffers are
    put back (BatchNorm saves its running statistics for the backward)."""
    params = [p for p in view.module.parameters() if p.requires_grad]
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not torch.is_grad_enabled() or not params or not leaves:
        return None
    gen = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for t in leaves]
    grads = torch.autograd.grad(leaves, params, cotangents, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


@contextlib.contextmanager
def _folded(args: tuple, kwargs: dict, in_dims: tuple, n: int) -> Iterator[tuple[tuple, dict]]:
    """The inputs folded to ``(N * B, ...)``, with the batched layers told the batch sizes."""
    batches: list[int] = []

    def fold(a: Any, per_member: bool) -> Any:
        if not isinstance(a, torch.Tensor) or a.dim() == 0:
            return a
        if per_member:
            batches.append(a.shape[1] if a.dim() > 1 else 1)
            return a.reshape(-1, *a.shape[2:]) if a.dim() > 1 else a
        batches.append(a.shape[0])
        return a.expand(n, *a.shape).reshape(-1, *a.shape[1:])

    fargs = tuple(fold(a, d == 0) for a, d in zip(args, in_dims))
    fkwargs = {k: fold(v, False) for k, v in kwargs.items()}
    with folding(n, batches):
        yield fargs, fkwargs


_LOSSES = {
    F.cross_entropy: "weighted", F.nll_loss: "weighted", F.mse_loss: "plain",
    F.l1_loss: "plain", F.smooth_l1_loss: "plain", F.huber_loss: "plain",
    F.binary_cross_entropy: "plain", F.binary_cross_entropy_with_logits: "plain",
}  # fmt: skip


class _MemberLosses(TorchFunctionMode):
    """A loss the member's forward computes itself (nanoGPT's ``model(idx, targets)``) is one
    number per member: reduced over each member's own rows of the folded batch, not over all.

    The result, ``(N,)``, is recorded in ``scalars``; an output that is one of these is the
    members' stacked scalars. Anything else done to it changes its identity, and the output
    check refuses it.
    """

    def __init__(self, n: int, scalars: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.n, self.scalars = n, scalars

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = _LOSSES.get(func)
        if kind is None:
            return func(*args, **kwargs)
        params = inspect.signature(func).bind(*args, **kwargs).arguments
        x, target = params["input"], params["target"]
        reduction = params.get("reduction", "mean")
        if (
            reduction not in ("mean", "sum")
            or params.get("size_average") is not None
            or params.get("reduce") is not None
            or not isinstance(target, torch.Tensor)
            or x.dim() == 0
            or x.shape[0] % self.n
            or target.shape[0] != x.shape[0]
            or (kind == "weighted" and params.get("label_smoothing", 0.0) > 0)
        ):
            return func(*args, **kwargs)
        per_element = func(**{**params, "reduction": "none"})
        loss = per_element.reshape(self.n, -1).sum(1)
        if reduction == "mean":
            if kind == "weighted":
                weight = params.get("weight")
                ignore = params.get("ignore_index", -100)
                keep = (target != ignore).to(per_element.dtype)
                if weight is not None:
                    keep = keep * weight[target.clamp(0, weight.shape[0] - 1)]
                loss = loss / keep.reshape(self.n, -1).sum(1)
            else:
                loss = loss / (per_element.numel() // self.n)
        self.scalars[id(loss)] = loss
        return loss


def _unfold_outputs(out: Any, n: int, sizes: set[int], scalars: dict[int, Any]) -> Any:
    """Each output ``(..., N * B, ...)`` as ``(N, ..., B, ...)``: the batch is dim 0 as a rule,
    a later dim where the member keeps an axis of its own in front (an ensemble's critics)."""

    def unfold(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or id(t) in scalars:
            return t
        dim = next((d for d, size in enumerate(t.shape) if size in sizes), None)
        if dim is None:
            raise BackendRefusal(
                f"an output of shape {tuple(t.shape)} does not carry the members' batches"
            )
        return t.unflatten(dim, (n, -1)).movedim(dim, 0)

    return pytree.tree_map(unfold, out)


class FusedBackend:
    """Runs the member's forward once on the folded batch with batched layers."""

    name = "fused"

    def forward(
        self,
        view: StackView,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: tuple[int | None, ...],
    ) -> Any:
        tree = fused_tree(view)
        cache = view.cache_of("fused")
        modes = _modes(cache, view.module)
        if cache["modes"] != modes:
            copy_modes(view.module, tree)
            cache["modes"] = modes
        if torch.compiler.is_compiling():
            self._check_outside_graph(view, tree, args, kwargs, in_dims, modes)
        elif _case(args, kwargs, in_dims, modes) not in cache["checked"]:
            self._check(view, tree, args, kwargs, in_dims, modes)
        return self._run(view, tree, args, kwargs, in_dims)

    @staticmethod
    def _run(view: StackView, tree: nn.Module, args: tuple, kwargs: dict, in_dims: tuple) -> Any:
        n = view.num_members
        shared_root = (
            isinstance(tree, BatchedMLP)
            and len(args) == 1
            and in_dims == (None,)
            and not kwargs
            and isinstance(args[0], torch.Tensor)
        )
        if shared_root:  # the MLP's first layer is one GEMM against every member's weights
            return tree.forward_shared(args[0])  # type: ignore[operator]
        cache = view.cache_of("fused")
        scalars: dict[int, torch.Tensor] = {}
        losses = _MemberLosses(n, scalars) if cache.get("losses") else contextlib.nullcontext()
        with _folded(args, kwargs, in_dims, n) as (fargs, fkwargs), losses:
            out = tree(*fargs, **fkwargs)
            sizes = set(fold_sizes())
        if not cache.get("losses") and any(
            isinstance(t, torch.Tensor) and t.dim() == 0 for t in pytree.tree_leaves(out)
        ):
            # A scalar output: the forward reduces a loss. From now on losses are reduced per
            # member (a mode costs a little on every op, so only where it is needed).
            cache["losses"] = True
            return FusedBackend._run(view, tree, args, kwargs, in_dims)
        return _unfold_outputs(out, n, sizes, scalars)

    @torch.compiler.disable
    def _check_outside_graph(self, *args: Any) -> None:
        """The check, kept out of torch.compile's graph (it compares values in Python)."""
        self._check(*args)

    def _check(
        self, view: StackView, tree: nn.Module, args: tuple, kwargs: dict, in_dims: tuple, modes
    ) -> None:
        checked: set = view.cache_of("fused")["checked"]
        case = _case(args, kwargs, in_dims, modes)
        if case in checked:
            return
        failure = self.verify(view, tree, args, kwargs, in_dims)
        if failure is not None:
            raise BackendRefusal(
                f"Stack.forward(): backend 'fused' does not match the reference on this input: "
                f"{failure}. The member's forward may mix samples across the batch (a mean "
                f"or reshape over dim 0), which the fused backend cannot honour. Use "
                f"phalanx.stack(models, backend='vmap'), or backend='auto', which hands over "
                f"by itself."
            )
        checked.add(case)

    def verify(
        self, view: StackView, tree: nn.Module, args: tuple, kwargs: dict, in_dims: tuple
    ) -> str | None:
        """Compares the fused output with the vmap (or loop) backend's on this input.

        Returns:
            None when they agree, else what differs. Buffers and RNG states are restored, so
            the check leaves no trace.
        """
        from phalanx._backends import get_backend

        # Equal outputs can hide different gradients: members whose parameters are still
        # equal (a LayerNorm at its initial 1 and 0) give the same values even where the
        # forward mixes them. So the parameters' gradients are compared too.
        with preserved(view), _Deterministic():
            try:
                with preserved(view):
                    expected = get_backend("vmap").forward(view, args, kwargs, in_dims)
                    expected_grads = _param_grads(view, expected)
            except Exception:  # vmap cannot run it: the loop is the specification anyway
                with preserved(view):
                    expected = get_backend("loop").forward(view, args, kwargs, in_dims)
                    expected_grads = _param_grads(view, expected)
            try:
                got = self._run(view, tree, args, kwargs, in_dims)
                got_grads = _param_grads(view, got)
            except Exception as e:
                return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
        failure = _compare(got, expected)
        if failure is None and expected_grads is not None:
            # A backward sums in more orders than a forward: ten times the forward's
            # tolerance still tells rounding from members mixed into each other.
            failure = _compare(got_grads, expected_grads, loose=10)
            if failure is not None:
                failure = "the parameters' gradients differ: " + failure
        return failure


BACKEND = FusedBackend()
