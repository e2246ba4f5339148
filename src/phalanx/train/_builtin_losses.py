"""torch's built-in losses on the whole ``(N, B, ...)`` output, reduced per member, without vmap.

Each loss here is elementwise (or per sample, over a class dimension) before its reduction, so
one call with ``reduction="none"`` on the stacked output gives every member's terms at once;
the reduction torch would apply to one member's ``(B, ...)`` terms is then applied per member.
That skips vmap's per-operator dispatch (its cost grows with the loss's operators, not with N)
and runs losses vmap cannot (``F.gaussian_nll_loss`` checks its variances in Python).

A call this module does not recognise exactly (an unknown keyword, a deprecated
``size_average``/``reduce``, targets that broadcast) returns None, and ``member_losses`` runs
the loss under vmap instead, as the loop would run it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor

# loss -> (its tensor arguments after the input, in order; its other keywords)
_ELEMENTWISE: dict[Callable[..., Tensor], tuple[tuple[str, ...], tuple[str, ...]]] = {
    F.mse_loss: (("target",), ()),
    F.l1_loss: (("target",), ()),
    F.smooth_l1_loss: (("target",), ("beta",)),
    F.huber_loss: (("target",), ("delta",)),
    F.binary_cross_entropy: (("target",), ("weight",)),
    F.binary_cross_entropy_with_logits: (("target",), ("weight", "pos_weight")),
    F.kl_div: (("target",), ("log_target",)),
    F.poisson_nll_loss: (("target",), ("log_input", "full", "eps")),
    F.gaussian_nll_loss: (("target", "var"), ("full", "eps")),
}
# Losses over a class dimension (dim 1 of a member's (B, C, ...) output).
_CLASSWISE: dict[Callable[..., Tensor], tuple[str, ...]] = {
    F.cross_entropy: ("label_smoothing", "weight", "ignore_index"),
    F.nll_loss: ("weight", "ignore_index"),
}
# Keywords holding a tensor shared by every member that torch broadcasts against a member's
# target (right-aligned, so the member axis in front changes nothing).
_BROADCAST = ("weight", "pos_weight")

BUILTIN = frozenset(_ELEMENTWISE) | frozenset(_CLASSWISE)


def batched_loss(
    loss_fn: Callable[..., Tensor],
    output: Tensor,
    targets: tuple[Any, ...],
    in_dims: tuple[int | None, ...],
    kwargs: dict[str, Any],
) -> Tensor | None:
    """The ``(N,)`` losses of a built-in loss computed in one call; None where this does not
    apply (the caller then runs the loss under vmap)."""
    if loss_fn not in BUILTIN or in_dims[0] != 0 or output.dim() < 2:
        return None
    kwargs = dict(kwargs)
    reduction = kwargs.pop("reduction", "mean")
    if loss_fn in _ELEMENTWISE:
        names, options = _ELEMENTWISE[loss_fn]
    else:
        names, options = ("target",), _CLASSWISE[loss_fn]
    # the mapped tensors (target, var) given positionally or by keyword
    given = list(targets)
    for name in names[len(given) :]:
        if name not in kwargs:
            break
        given.append(kwargs.pop(name))
        in_dims = (*in_dims, None)
    if len(given) != len(names) or not set(kwargs) <= set(options):
        return None
    n = output.shape[0]
    mapped: list[Any] = []
    for value, dim in zip(given, in_dims[1:]):
        if isinstance(value, Tensor):
            value = value.expand(n, *value.shape) if dim is None else value
            if value.shape[:1] != (n,):
                return None
        elif not (isinstance(value, float) and loss_fn is F.gaussian_nll_loss):
            return None
        mapped.append(value)
    for key in _BROADCAST:
        value = kwargs.get(key)
        if value is not None and (not isinstance(value, Tensor) or value.dim() >= output.dim()):
            return None
    if loss_fn in _CLASSWISE:
        return _classwise(loss_fn, output, mapped[0], reduction, kwargs)
    return _elementwise(loss_fn, output, mapped, reduction, kwargs)


def _member_reduce(terms: Tensor, reduction: str) -> Tensor | None:
    dims = tuple(range(1, terms.dim()))
    if reduction == "mean":
        return terms.mean(dim=dims)
    if reduction == "sum":
        return terms.sum(dim=dims)
    return None


def _elementwise(
    loss_fn: Callable[..., Tensor],
    output: Tensor,
    mapped: list[Any],
    reduction: str,
    kwargs: dict[str, Any],
) -> Tensor | None:
    target = mapped[0]
    if not isinstance(target, Tensor) or target.shape != output.shape:
        return None  # broadcasting targets: let the loss itself warn or refuse, per member
    if loss_fn is F.gaussian_nll_loss:
        var = mapped[1]
        shape = tuple(output.shape)
        if isinstance(var, Tensor) and tuple(var.shape) not in (
            shape,
            shape[:-1],
            (*shape[:-1], 1),
        ):
            return None
    if loss_fn is F.kl_div:
        if reduction not in ("mean", "sum", "batchmean"):
            return None
        terms = loss_fn(output, target, reduction="none", **kwargs)
        if reduction == "batchmean":
            # a member's input.size(0): the dim after the member axis
            return terms.sum(dim=tuple(range(1, terms.dim()))) / output.shape[1]
        if reduction == "mean":
            # torch's own warning, which each member's call would give: from torch itself,
            # on one element
            loss_fn(output.new_zeros(1), target.new_zeros(1), reduction="mean")
        return _member_reduce(terms, reduction)
    if reduction not in ("mean", "sum"):
        return None
    terms = loss_fn(output, *mapped, reduction="none", **kwargs)
    if terms.shape[:1] != output.shape[:1]:
        return None
    return _member_reduce(terms, reduction)


def _classwise(
    loss_fn: Callable[..., Tensor],
    output: Tensor,
    target: Any,
    reduction: str,
    kwargs: dict[str, Any],
) -> Tensor | None:
    if output.dim() < 3 or not isinstance(target, Tensor) or reduction not in ("mean", "sum"):
        return None
    weight = kwargs.get("weight")
    if weight is not None and weight.dim() != 1:
        return None
    # The members become the loss's batch and a member's batch its first "spatial" dim:
    # (N, B, C, ...) is read as (N, C, B, ...), a view, with no copy of a shared target.
    logits = output.movedim(2, 1)
    if target.is_floating_point():  # class probabilities, shaped like the output
        if target.shape != output.shape:
            return None
        per_sample = loss_fn(logits, target.movedim(2, 1), reduction="none", **kwargs)
        return _member_reduce(per_sample, reduction)
    if target.shape != output.shape[:2] + output.shape[3:]:
        return None
    per_sample = loss_fn(logits, target, reduction="none", **kwargs)
    if reduction == "sum":
        return _member_reduce(per_sample, reduction)
    # reduction="mean" divides by the number of samples not equal to ignore_index, or with
    # class weights by the sum of their targets' weights (label smoothing's term included); a
    # member whose every sample is ignored gets 0 / 0, NaN, as its own call does.
    counted = target != kwargs.get("ignore_index", -100)
    dims = tuple(range(1, target.dim()))
    if weight is None:
        total = counted.sum(dim=dims)
    else:
        picked = weight.to(per_sample.dtype)[target.where(counted, 0)]
        total = picked.where(counted, 0).sum(dim=dims)
    return per_sample.sum(dim=dims) / total
