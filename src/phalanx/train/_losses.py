"""Per-member losses: the sum over members gives each member exactly its own gradient."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.func import vmap

from phalanx._errors import summary
from phalanx._torch_compat import pytree
from phalanx.backends._outputs import refuse_opaque
from phalanx.core._hf import own_loss
from phalanx.train import _smoothing
from phalanx.train._builtin_losses import BUILTIN, batched_loss
from phalanx.train._loss_checks import check_targets


def member_losses(
    loss_fn: Callable[..., torch.Tensor] | None,
    output: Any,
    target: Any = None,
    *more_targets: Any,
    in_dims: tuple[int | None, ...] = (0, None),
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
        *more_targets: further tensors ``loss_fn`` takes after the target, e.g. the variances
            of ``F.gaussian_nll_loss(out, y, var)``; ``in_dims`` then has one entry for each
            (``in_dims=(0, 0, 0)``: all per-member). With the default ``in_dims`` they are
            shared by every member.
        in_dims: how ``output`` and each target map over the member axis, as in
            ``torch.func.vmap``.
        **kwargs: passed to ``loss_fn`` for every member (e.g. ``label_smoothing=0.1``).
            ``label_smoothing`` may also be one value per member, an ``(N,)`` tensor or a
            list, with ``F.cross_entropy`` (a smoothing sweep).

    torch's built-in losses (``cross_entropy``, ``nll_loss``, ``mse_loss``, ``l1_loss``,
    ``smooth_l1_loss``, ``huber_loss``, ``binary_cross_entropy`` (``_with_logits``),
    ``kl_div``, ``gaussian_nll_loss``, ``poisson_nll_loss``), passed as themselves, run once
    on the whole ``(N, B, ...)`` output with the reduction applied per member: equal to each
    member's own call to float rounding, without vmap's per-operator cost. Any other
    ``loss_fn`` (a lambda, a function of your own) runs under ``torch.func.vmap``; one that
    vmap cannot run (a Python ``if`` on a tensor's value, ``.item()``) raises an error that
    says how to write it. For speed with a loss of your own, pass the built-in loss itself
    and reshape the output first (``member_losses(F.mse_loss, out.squeeze(-1), y)``) or
    reduce per member yourself (``((out - y) ** 2).mean(dim=(1, 2))``).

    Returns:
        ``(N,)``: the members' losses.

    Raises:
        ValueError: the target carries the member axis but ``in_dims`` says it is shared (or
            ``in_dims`` says per-member and its first size is not N), or ``loss_fn`` does not
            return one scalar per member.
        RuntimeError: ``loss_fn`` is a function of your own that ``torch.func.vmap`` cannot
            run; the message names the fix.
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
    targets = (target, *more_targets)
    if isinstance(in_dims, list):
        in_dims = tuple(in_dims)
    if more_targets and in_dims == (0, None):
        in_dims = (0,) + (None,) * len(targets)  # the default: every target shared
    if (
        not isinstance(in_dims, tuple)
        or len(in_dims) != 1 + len(targets)
        or any(d not in (0, None) or isinstance(d, bool) for d in in_dims)
        or all(d is None for d in in_dims)
    ):
        entries = (
            "the output and the target"
            if not more_targets
            else (f"the output and each of the {len(targets)} targets")
        )
        raise ValueError(
            f"{where}: in_dims={in_dims!r} must say where the member axis is, one entry for "
            f"{entries}: 0 (dim 0 is the member axis) or None (shared by every member), at "
            f"least one of them 0. The stack's output carries the member axis: "
            f"in_dims=(0, None) for a target shared by every member, (0, 0) for per-member "
            f"targets."
        )
    if not isinstance(output, torch.Tensor) and in_dims[0] == 0:
        return _structured_losses(loss_fn, output, targets, in_dims[1:], kwargs, where)
    if _smoothing.is_per_member(kwargs):
        return _smoothing.smoothed_losses(member_losses, loss_fn, output, target, in_dims, kwargs)
    for k, (each, dim) in enumerate(zip(targets, in_dims[1:])):
        if (
            dim is None
            and isinstance(each, torch.Tensor)
            and in_dims[0] == 0
            and each.shape == output.shape
            and each.dim() > 0
        ):
            which = "the target" if k == 0 else f"target {k + 1}"
            fix = "(0, 0)" if not more_targets else "with 0 for it"
            raise ValueError(
                f"{where}: {which} has the output's shape {tuple(output.shape)}, member axis "
                f"included, but in_dims={in_dims} treats it as shared by every member. For a "
                f"per-member target pass in_dims={fix}; for a shared one pass a target "
                f"without the member axis."
            )
    for each, dim in zip(
        targets, in_dims[1:]
    ):  # per-member targets declared shared, or the reverse
        check_targets(output, each, (in_dims[0], dim))
    losses = None
    if isinstance(output, torch.Tensor):
        losses = batched_loss(loss_fn, output, targets, in_dims, kwargs)
    if losses is None:
        losses = _vmapped(loss_fn, output, targets, in_dims, kwargs, where)
    n = output.shape[0] if in_dims[0] == 0 else _member_count(targets, in_dims)
    return _checked(losses, n, where)


# torch.func.vmap's own refusals (its messages begin "vmap:" or name a batching rule)
_VMAP_REFUSALS = ("vmap:", "Batching rule not implemented", "data-dependent", "vmap over")


def _vmapped(
    loss_fn: Callable[..., torch.Tensor],
    output: Any,
    targets: tuple[Any, ...],
    in_dims: tuple[int | None, ...],
    kwargs: dict[str, Any],
    where: str,
) -> Any:
    """``loss_fn`` on each member under vmap; vmap's refusals re-raised saying what to do."""
    try:
        return vmap(lambda o, *t: loss_fn(o, *t, **kwargs), in_dims=in_dims)(output, *targets)
    except RuntimeError as e:
        if not any(mark in str(e) for mark in _VMAP_REFUSALS):
            raise
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        builtin = ", ".join(sorted(f"F.{f.__name__}" for f in BUILTIN))
        raise RuntimeError(
            f"{where}: loss_fn {name!r} cannot run on one member at a time under "
            f"torch.func.vmap, which member_losses uses for a loss function of your own: "
            f"{summary(e)}. Either pass torch's built-in loss itself ({builtin}), which runs "
            f"on the whole (N, B, ...) output without vmap, with its extra tensors after the "
            f"target (member_losses(F.gaussian_nll_loss, out, y, var, in_dims=(0, 0, 0))); or "
            f"compute the (N,) losses yourself on the stacked output, reducing every dim but "
            f"the member axis (((out - y) ** 2).mean(dim=tuple(range(1, out.dim())))), "
            f"without Python branches on a tensor's value or .item()."
        ) from e


def _member_count(targets: tuple[Any, ...], in_dims: tuple[int | None, ...]) -> int:
    return next(t.shape[0] for t, d in zip(targets, in_dims[1:]) if d == 0)


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
    targets: tuple[Any, ...],
    target_dims: tuple[int | None, ...],
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
    per_member = vmap(lambda o, *t: loss_fn(o, *t, **kwargs), in_dims=(dims, *target_dims))
    try:
        losses = per_member(tree, *targets)
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
