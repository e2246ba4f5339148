"""Every private torch API phalanx uses, behind one seam, with the torch it was checked on.

Each function here reads something torch does not expose publicly. They were written against
torch 2.13; where a name is missing in another release the function degrades to the safe
answer (the one that keeps phalanx on its exact general path) rather than failing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

CHECKED_ON = "2.13"
"""The torch release these functions were read from."""


def transforms_active() -> bool:
    """True inside a ``torch.func`` transform (vmap, grad, jacrev, jvp...).

    ``torch._C._functorch.maybe_current_level`` is None outside every transform.
    """
    level = getattr(torch._C._functorch, "maybe_current_level", None)
    return True if level is None else level() is not None


def forward_ad_active() -> bool:
    """True inside ``torch.autograd.forward_ad.dual_level()``."""
    from torch.autograd import forward_ad

    return getattr(forward_ad, "_current_level", -1) >= 0


def has_tangents(tensors: Iterable[torch.Tensor]) -> bool:
    """True when forward-mode AD is on and one of ``tensors`` carries a tangent."""
    from torch.autograd import forward_ad

    if not forward_ad_active():
        return False
    return any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def global_module_hooks() -> bool:
    """True when a global module hook (``register_module_forward_hook`` ...) is registered."""
    from torch.nn.modules import module

    names = (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
    )
    return any(getattr(module, name, None) for name in names)


def assert_async(condition: torch.Tensor, message: str) -> None:
    """``torch._assert_async``: raises on the device (no host sync), traceable."""
    torch._assert_async(condition, message)


def version(t: torch.Tensor) -> int:
    """``Tensor._version``: how often ``t`` was written in place."""
    return t._version


def is_wrapped(t: torch.Tensor) -> bool:
    """True for a torch.func wrapper (a batched or grad-tracking tensor), False for a plain one."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return True if check is None else bool(check(t))


def checkpoint_site(frame: Any) -> tuple[str, Any] | None:
    """Where a saved-tensor pack hook was called from, if ``torch.utils.checkpoint`` saved.

    Returns ``("frame", _CheckpointFrame)`` when the non-reentrant checkpoint saves its
    inputs (``_CheckpointFrame.save_inputs``, from a list comprehension: its frame or the one
    above), ``("reentrant", None)`` when ``CheckpointFunction`` saves them through
    ``Function.apply``, else None. Without these names (another torch) it returns None.
    """
    from torch.autograd.function import Function
    from torch.utils import checkpoint as cp

    save = getattr(getattr(cp, "_CheckpointFrame", None), "save_inputs", None)
    code = getattr(save, "__code__", None)
    for f in (frame, frame.f_back):
        if f is not None and f.f_code is code:
            return "frame", f.f_locals["self"]
    apply = getattr(Function.apply, "__func__", None)
    if (
        apply is not None
        and frame.f_code is apply.__code__
        and frame.f_locals.get("cls") is getattr(cp, "CheckpointFunction", None)
    ):
        return "reentrant", None
    return None


def reparametrized(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Any:
    """The context ``torch.func.functional_call`` runs a module in: ``tensors`` swapped in
    by name (ties kept), put back on exit. ``torch.nn.utils.stateless._reparametrize_module``."""
    from torch.nn.utils import stateless

    return stateless._reparametrize_module(module, tensors, tie_weights=True)


def vmap_rule_inline(func: Any, rule: Any, args: tuple) -> Any:
    """Runs a batching rule where an ``autograd.Function``'s vmap staticmethod would run,
    without the Function: what ``torch._functorch.autograd_function``'s vmap helper does.

    For ``torch.export`` only: in torch 2.13 its pre-dispatch tracer has no rule for the
    ``custom_function_call`` operator that a Function becomes under vmap ("Current active
    mode ProxyTorchDispatchMode not registered"). ``rule(batch_size, in_dims, *args)``
    returns ``(outputs, out_dims)`` on the unwrapped tensors, like the staticmethod; ``func``
    runs where nothing is batched at this level. Returns None outside a vmap level.
    """
    from torch._C._functorch import TransformType, is_batchedtensor, maybe_get_level
    from torch._functorch import predispatch  # the forms torch.export traces
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    if torch._C._functorch.maybe_current_level() is None:
        return None
    interpreter = retrieve_current_functorch_interpreter()
    if interpreter.key() != TransformType.Vmap:
        return None
    level, n = interpreter.level(), interpreter.batch_size()  # type: ignore[attr-defined]
    # The traced values are the batched tensors themselves: unwrap through the traced
    # _remove_batch_dim (the batch moved to dim 0), not torch._C's untraced unwrap.
    batched = [
        isinstance(a, torch.Tensor) and is_batchedtensor(a) and maybe_get_level(a) == level
        for a in args
    ]
    unwrapped = tuple(
        predispatch._remove_batch_dim(a, level, n, 0) if b else a for a, b in zip(args, batched)
    )
    in_dims = tuple(0 if b else None for b in batched)
    with interpreter.lower():
        if all(d is None for d in in_dims):
            return func(*args)
        out, out_dims = rule(n, in_dims, *unwrapped)

    def wrap(o: Any, d: int | None) -> Any:  # batch first: relu of a bdim-1 wrapper leaks
        # an untraced tensor into the exported graph (torch 2.13)
        if d is None or not isinstance(o, torch.Tensor):
            return o
        return predispatch._add_batch_dim(o.movedim(d, 0), 0, level)

    if isinstance(out, torch.Tensor):
        return wrap(out, out_dims)
    return tuple(wrap(o, d) for o, d in zip(out, out_dims))


def unwrapped_member_first(t: Any) -> torch.Tensor | None:
    """Under ``torch.export``: a tensor batched at the current vmap level, unwrapped with its
    member axis first through the traced ``_remove_batch_dim``; None for any other value."""
    from torch._C._functorch import is_batchedtensor, maybe_get_level
    from torch._functorch import predispatch
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    if torch._C._functorch.maybe_current_level() is None:
        return None
    interpreter = retrieve_current_functorch_interpreter()
    if (
        not isinstance(t, torch.Tensor)
        or not is_batchedtensor(t)
        or maybe_get_level(t) != interpreter.level()
    ):
        return None
    n = interpreter.batch_size()  # type: ignore[attr-defined]
    return predispatch._remove_batch_dim(t, interpreter.level(), n, 0)
