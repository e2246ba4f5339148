"""Per-member losses: the sum over members gives each member exactly its own gradient."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import vmap

from phalanx._errors import summary
from phalanx._torch_compat import pytree
from phalanx.backends._outputs import refuse_opaque
from phalanx.core._hf import own_loss
from phalanx.train import _smoothing
from phalanx.train._loss_checks import check_targets

# Losses that are a mean of per-element terms: computed once on (N, B, ...) with
# reduction="none", then averaged per member, instead of through vmap's per-call overhead.
_ELEMENTWISE = {
    F.mse_loss: (),
    F.l1_loss: (),
    F.smooth_l1_loss: ("beta",),
    F.huber_loss: ("delta",),
    F.binary_cross_entropy_with_logits: (),
    F.binary_cross_entropy: (),
}
# Losses over a class dimension (dim 1 of a member's (B, C, ...) output) with a mean over
# the samples: computed on the (N * B, C, ...) flattening.
# A class `weight` of shape (C,) is shared by the members; with class indices the mean is then
# over the targets' weights, as torch's reduction="mean" divides.
_CLASSWISE = {
    F.cross_entropy: ("label_smoothing", "weight", "ignore_index"),
    F.nll_loss: ("weight", "ignore_index"),
}


def _batched_loss(
    loss_fn: Callable[..., torch.Tensor],
    output: torch.Tensor,
    target: Any,
    in_dims: tuple[int | None, int | None],
    kwargs: dict[str, Any],
) -> torch.Tensor | None:
    """The (N,) losses without vmap for the common losses with a plain mean; else None."""
    if not isinstance(target, torch.Tensor) or in_dims[0] != 0 or output.dim() < 2:
        return None
    n = output.shape[0]
    if in_dims[1] is None:
        target = target.expand(n, *target.shape)
    # A mean over every dim but the member axis, without flattening: the outputs of the fused
    # backend are often strided views, which flatten(1) would copy (and copy back in backward).
    if loss_fn in _ELEMENTWISE and set(kwargs) <= set(_ELEMENTWISE[loss_fn]):
        if target.shape != output.shape:
            return None  # broadcasting targets: let the loss itself warn or refuse
        per_element = loss_fn(output, target, reduction="none", **kwargs)
        return per_element.mean(dim=tuple(range(1, per_element.dim())))
    if loss_fn in _CLASSWISE and set(kwargs) <= set(_CLASSWISE[loss_fn]) and output.dim() >= 3:
        if target.shape[:2] != output.shape[:2]:
            return None
        # The members become the loss's batch and a member's batch its first "spatial" dim:
        # (N, B, C, ...) is read as (N, C, B, ...), a view, with no copy of a shared target.
        if target.is_floating_point():  # class probabilities, shaped like the output
            if target.shape != output.shape:
                return None
            per_sample = loss_fn(output.movedim(2, 1), target.movedim(2, 1), reduction="none",
                                 **kwargs)  # fmt: skip
            return per_sample.mean(dim=tuple(range(1, per_sample.dim())))
        weight = kwargs.get("weight")
        if weight is not None and (not isinstance(weight, torch.Tensor) or weight.dim() != 1):
            return None
        per_sample = loss_fn(output.movedim(2, 1), target, reduction="none", **kwargs)
        # reduction="mean" divides by the number of samples not equal to ignore_index, or with
        # class weights by the sum of their targets' weights (label smoothing's term included)
        counted = target != kwargs.get("ignore_index", -100)
        dims = tuple(range(1, target.dim()))
        if weight is None:
            total = counted.sum(dim=dims)
        else:
            picked = weight.to(per_sample.dtype)[target.where(counted, 0)]
            total = picked.where(counted, 0).sum(dim=dims)
        return per_sample.sum(dim=tuple(range(1, per_sample.dim()))) / total
    return None


def member_losses(
    loss_fn: Callable[..., torch.Tensor] | None,
    output: Any,
    target: Any = None,
    *,
    in_dims: tuple[int | None, int | None] = (0, None),
    **kwargs: Any,
) -> torch.Tensor:
    """Applies ``loss_fn`` to each member's output alone and returns one loss per member.

    Backpropagate ``member_losses(...).sum()``: member i's parameters then get exactly the
    gradient of member i's own loss. The tempting ``loss_fn(output.flatten(0, 1), ...)`` with
    ``reduction="mean"`` divides every member's gradient by N instead.

    Args:
        loss_fn: a loss such as ``torch.nn.functional.cross_entropy`` that returns a scalar
            for one member's ``(B, ...)`` output; or None for the loss each member computed
            itself: the output's ``.loss`` (a Hugging Face ``ModelOutput`` of a call with
            ``labels=``), or a tuple's first element, ``(N,)``. For a structured output (a
            tuple, list, dict, dataclass or ``ModelOutput``) it is given each member's whole
            output, as the model returns it, and reads what it needs
            (``lambda out, y: F.mse_loss(out[0], y) + F.mse_loss(out[1], y)``).
        output: the stack's output, ``(N, B, ...)``, or a tuple, list, dict, dataclass or
            ``ModelOutput`` of such tensors.
        target: ``(B, ...)`` shared by every member (the default), or ``(N, B, ...)`` with
            ``in_dims=(0, 0)`` for per-member targets.
        in_dims: how ``output`` and ``target`` map over the member axis, as in
            ``torch.func.vmap``.
        **kwargs: passed to ``loss_fn`` for every member (e.g. ``label_smoothing=0.1``).
            ``label_smoothing`` may also be one value per member, an ``(N,)`` tensor or a
            list, with ``F.cross_entropy`` (a smoothing sweep).

    Returns:
        ``(N,)``: the members' losses.

    Raises:
        ValueError: the target carries the member axis but ``in_dims`` says it is shared (or
            ``in_dims=(0, 0)`` and its first size is not N), or ``loss_fn`` does not return
            one scalar per member.
        TypeError: ``loss_fn`` cannot read a member's structured output (it raised a
            TypeError, AttributeError, KeyError or IndexError on it).

    Example:
        >>> stack = phalanx.stack([nn.Linear(4, 3) for _ in range(5)])
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))  # one batch for every member
        >>> losses = phalanx.member_losses(F.cross_entropy, stack(x), y)
        >>> losses.shape
        torch.Size([5])
        >>> losses.sum().backward()  # member i's gradient is that of its own loss alone
    """
    where = "phalanx.member_losses()"
    if loss_fn is None:
        return own_loss(output, None, where)
    if not callable(loss_fn):
        raise TypeError(
            f"{where}: the loss function comes first: member_losses(loss_fn, output, target); "
            f"got a {type(loss_fn).__name__} where loss_fn goes."
        )
    if isinstance(in_dims, list):
        in_dims = (in_dims[0], in_dims[1]) if len(in_dims) == 2 else in_dims
    if (
        not isinstance(in_dims, tuple)
        or len(in_dims) != 2
        or any(d not in (0, None) or isinstance(d, bool) for d in in_dims)
        or in_dims == (None, None)
    ):
        raise ValueError(
            f"{where}: in_dims={in_dims!r} must say where the member axis is: 0 (dim 0 is "
            f"the member axis) or None (shared by every member) for the output and the "
            f"target, at least one of them 0. The stack's output carries the member axis: "
            f"in_dims=(0, None) for a target shared by every member, (0, 0) for per-member "
            f"targets."
        )
    if not isinstance(output, torch.Tensor) and in_dims[0] == 0:
        return _structured_losses(loss_fn, output, target, in_dims[1], kwargs, where)
    if _smoothing.is_per_member(kwargs):
        return _smoothing.smoothed_losses(member_losses, loss_fn, output, target, in_dims, kwargs)
    if (
        in_dims[1] is None
        and isinstance(target, torch.Tensor)
        and in_dims[0] == 0
        and target.shape == output.shape
        and target.dim() > 0
    ):
        raise ValueError(
            f"{where}: the target has the output's shape {tuple(output.shape)}, member axis "
            f"included, but in_dims={in_dims} treats it as shared by every member. For a "
            f"per-member target pass in_dims=(0, 0); for a shared one pass a target without the "
            f"member axis."
        )
    check_targets(output, target, in_dims)  # per-member targets declared shared, or the reverse
    losses = _batched_loss(loss_fn, output, target, in_dims, kwargs)
    if losses is None:
        losses = vmap(lambda o, t: loss_fn(o, t, **kwargs), in_dims=in_dims)(output, target)
    n = output.shape[0] if in_dims[0] == 0 else target.shape[0]
    return _checked(losses, n, where)


def _checked(losses: Any, n: int, where: str) -> torch.Tensor:
    if not isinstance(losses, torch.Tensor) or losses.shape != (n,):
        got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(
            f"{where}: loss_fn must return one scalar per member, giving shape ({n},); got "
            f"{got}. Use reduction='mean' or 'sum', and return the loss alone (a tensor)."
        )
    return losses


def _structured_losses(
    loss_fn: Callable[..., torch.Tensor],
    output: Any,
    target: Any,
    target_dim: int | None,
    kwargs: dict[str, Any],
    where: str,
) -> torch.Tensor:
    """The (N,) losses of ``loss_fn`` on each member's whole output: a tuple, list, dict,
    Hugging Face ``ModelOutput`` (a registered pytree node) or dataclass of ``(N, ...)``
    tensors (dataclasses registered with ``torch.export.register_dataclass``), given to
    ``loss_fn`` as that member's own output, as the loop gives it."""
    tree = output
    leaves = pytree.tree_leaves(tree)
    refuse_opaque(leaves, where)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors:
        raise TypeError(
            f"{where}: the output is a {type(output).__name__} holding no tensor that vmap can "
            f"map over the members; return tensors (or a tuple, list, dict or dataclass of "
            f"them) from the model, or give member_losses the tensor the loss reads."
        )
    n = tensors[0].shape[0] if tensors[0].dim() else 0
    if any(x.dim() == 0 or x.shape[0] != n for x in tensors):
        raise ValueError(
            f"{where}: every tensor of the output ({_describe(output, tree, member=False)}) "
            f"must carry the member axis first, (N, ...) with the same N, as the stack "
            f"returns them."
        )
    dims = pytree.tree_map(lambda x: 0 if isinstance(x, torch.Tensor) else None, tree)
    per_member = vmap(lambda o, t: loss_fn(o, t, **kwargs), in_dims=(dims, target_dim))
    try:
        losses = per_member(tree, target)
    except (TypeError, AttributeError, KeyError, IndexError) as e:
        hint = f"lambda out, y: F.mse_loss({_first_part(output)}, y)"
        if hasattr(output, "loss") or (isinstance(output, Mapping) and "loss" in output):
            hint += (
                ", or loss_fn=None to use the loss each member computed itself (its "
                "output's .loss, from labels=...)"
            )
        raise TypeError(
            f"{where}: loss_fn could not read a member's output, {_describe(output, tree)} "
            f"(not a tensor): {summary(e)}. loss_fn is given each member's whole output as the "
            f"model returns it; read the part the loss needs, e.g. {hint}."
        ) from e
    return _checked(losses, n, where)


def _first_part(output: Any) -> str:
    """How a loss reads the output's first tensor: ``out[0]``, ``out["mean"]``, ``out.logits``."""
    if dataclasses.is_dataclass(output) and not isinstance(output, Mapping):
        return f"out.{dataclasses.fields(output)[0].name}"
    if isinstance(output, Mapping) and output:
        key = next(iter(output))
        return f"out.{key}" if hasattr(output, "loss") else f"out[{key!r}]"
    return "out[0]"


def _describe(output: Any, tree: Any, member: bool = True) -> str:
    """``a tuple of tensors (8, 1), (8, 1)``: the type and each tensor leaf's shape, a
    member's own (the member axis dropped) where ``member``."""
    fields = ""
    if isinstance(output, Mapping):
        fields = f" with fields {list(output.keys())}"
    elif dataclasses.is_dataclass(output):
        fields = f" with fields {[f.name for f in dataclasses.fields(output)]}"
    shapes = [
        tuple(x.shape[member:]) for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)
    ]
    return f"a {type(output).__name__}{fields} of tensors {', '.join(map(str, shapes))}"
