"""The fused backend: the member's own ``forward`` runs once on ``(N, B, ...)`` tensors.

A copy of the member's module tree is made in which every known layer is swapped for its
batched version (``_fused_layers``); containers, elementwise layers and parameter-free custom
modules keep their own ``forward``. Shared inputs enter as views expanded over the member
axis, which the batched layers recognise.

A member's forward may do something the batched layers cannot honour (a reshape over the
batch dimension, a reduction over dim 0). That would silently give a wrong answer, so the
first call with each new input signature is checked against the vmap backend (or the loop,
where vmap cannot run) on the same input, with dropout off and every side effect undone; a
mismatch raises ``FusedUnsupported``, on which ``auto`` falls back to vmap.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from phalanx._backends._fused_layers import FusedUnsupported, classify
from phalanx._backends._fused_mlp import BatchedMLP, mlp_layers
from phalanx._modules import copy_modes

if TYPE_CHECKING:
    from phalanx._stack import Stack

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
            nn.FeatureAlphaDropout)  # fmt: skip
_PROBE_LIMIT = 16  # distinct input signatures checked per stack; later ones are trusted


def build_tree(stack: Stack) -> nn.Module:
    """The member's module tree with batched layers, reading the stack's tensors.

    Raises:
        FusedUnsupported: a submodule holds parameters or buffers of a type with no batched
            version.
    """
    tree = copy.deepcopy(stack._template)
    n = len(stack)
    unsupported: list[str] = []
    replaced: list[str] = []
    for path, sub in list(tree.named_modules()):
        if any(path.startswith(p + ".") or p == "" for p in replaced):
            continue
        kind, factory = ("batched", BatchedMLP) if mlp_layers(sub) else classify(sub)
        if kind == "unsupported":
            unsupported.append(f"{path or '<root>'!r} ({type(sub).__name__})")
        elif kind == "batched" and factory is not None:
            batched = factory(stack.module.get_submodule(path), n)
            replaced.append(path)
            if path == "":
                tree = batched
            else:
                parent, _, leaf = path.rpartition(".")
                setattr(tree.get_submodule(parent), leaf, batched)
    if unsupported:
        raise FusedUnsupported(
            "no batched layer for the submodule(s) holding tensors: " + ", ".join(unsupported)
        )
    copy_modes(stack.module, tree)
    return tree


def fused_tree(stack: Stack) -> nn.Module:
    """The stack's fused tree, built on first use and cached on the stack."""
    tree = stack.__dict__.get("_fused_tree")
    if tree is None:
        tree = build_tree(stack)
        stack.__dict__["_fused_tree"] = tree
        stack.__dict__["_fused_probed"] = set()
    return tree


def _signature(args: tuple, kwargs: dict, in_dims: tuple) -> tuple:
    def sig(a: Any) -> Any:
        return (tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else type(a)

    return (
        tuple(sig(a) for a in args),
        in_dims,
        tuple(sorted((k, sig(v)) for k, v in kwargs.items())),
    )


@contextlib.contextmanager
def _dropout_off(*modules: nn.Module) -> Iterator[None]:
    saved = [(m, m.training) for root in modules for m in root.modules() if isinstance(m, _DROPOUT)]
    for m, _ in saved:
        m.training = False
    try:
        yield
    finally:
        for m, mode in saved:
            m.training = mode


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 2e-2
    if dtype == torch.float64:
        return 1e-9, 1e-9
    return 1e-4, 1e-5


def _compare(got: Any, expected: Any) -> str | None:
    g_flat, g_spec = pytree.tree_flatten(got)
    e_flat, e_spec = pytree.tree_flatten(expected)
    if g_spec != e_spec:
        return f"the output structure differs ({g_spec} against {e_spec})"
    for k, (g, e) in enumerate(zip(g_flat, e_flat)):
        if not isinstance(e, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != e.shape:
            shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            return f"output {k} has shape {shape}, the reference {tuple(e.shape)}"
        if not e.is_floating_point():
            if not torch.equal(g, e):
                return f"output {k} differs from the reference"
            continue
        # Under autocast one side may have computed in lower precision than the other.
        rtol, atol = max(_tolerance(e.dtype), _tolerance(g.dtype))
        wide = torch.promote_types(g.dtype, e.dtype)
        g, e = g.to(wide), e.to(wide)
        finite = e[torch.isfinite(e)]  # a diverged member's NaNs must not poison the scale
        scale = 1.0 + finite.abs().max().item() if finite.numel() else 1.0
        # allclose with equal_nan counts NaN == NaN and equal infinities as agreeing.
        if not torch.allclose(g, e, rtol=rtol, atol=atol * scale, equal_nan=True):
            err = (g - e).abs().max().item()
            return f"output {k} differs from the reference by up to {err:.3g}"
    return None


class FusedBackend:
    """Runs the member's forward once on ``(N, B, ...)`` tensors with batched layers."""

    name = "fused"

    def forward(
        self,
        stack: Stack,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: tuple[int | None, ...],
    ) -> Any:
        tree = fused_tree(stack)
        probed: set = stack.__dict__["_fused_probed"]
        if len(probed) < _PROBE_LIMIT:
            sig = _signature(args, kwargs, in_dims)
            if sig not in probed:
                failure = self.verify(stack, tree, args, kwargs, in_dims)
                if failure is not None:
                    raise FusedUnsupported(failure)
                probed.add(sig)
        return self._run(stack, tree, args, kwargs, in_dims)

    @staticmethod
    def _run(stack: Stack, tree: nn.Module, args: tuple, kwargs: dict, in_dims: tuple) -> Any:
        n = len(stack)
        args = tuple(
            a.expand(n, *a.shape) if d is None and isinstance(a, torch.Tensor) else a
            for a, d in zip(args, in_dims)
        )
        kwargs = {
            k: v.expand(n, *v.shape) if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()
        }
        return tree(*args, **kwargs)

    def verify(
        self, stack: Stack, tree: nn.Module, args: tuple, kwargs: dict, in_dims: tuple
    ) -> str | None:
        """Compares the fused output with the vmap (or loop) backend's on this input.

        Returns:
            None when they agree, else why not. Buffers and RNG states are restored, so the
            check leaves no trace.
        """
        from phalanx._backends import get_backend

        saved = stack._save_side_effects()
        try:
            with torch.no_grad(), _dropout_off(stack.module, tree):
                try:
                    expected = get_backend("vmap").forward(stack, args, kwargs, in_dims)
                except Exception:  # vmap cannot run it: the loop is the specification anyway
                    stack._restore_side_effects(saved)
                    expected = get_backend("loop").forward(stack, args, kwargs, in_dims)
                stack._restore_side_effects(saved)
                try:
                    got = self._run(stack, tree, args, kwargs, in_dims)
                except Exception as e:
                    return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
        finally:
            stack._restore_side_effects(saved)
        failure = _compare(got, expected)
        if failure is not None:
            return (
                f"{failure} (the member's forward may reshape or reduce over the batch "
                f"dimension, which the fused layers cannot honour)"
            )
        return None


BACKEND = FusedBackend()
