"""The vmap backends: the member's own ``forward`` under ``torch.func.vmap`` over the members.

Everything a forward does is then per member by construction (torch.func's batching rules
compute each batch element as the function would alone): a mean over the batch, ``x[0]``, a
reshape, a raw ``nn.Parameter`` used in ``torch.cat`` or ``matmul``. What cannot be batched is
detected where it happens: torch.func raises when a member's data becomes a Python value
(``bool(x.sum() > 0)``, ``.item()``, ``tolist()``) or when a function has no batching rule,
and the backend refuses with torch's reason. Parameters and buffers are mapped over dim 0,
per-member inputs too; shared inputs and keyword arguments are broadcast. Random operations
draw independently for each member (``randomness="different"``).

``vmap`` uses torch.func's own rules except where they are not exact (``rules.CORRECTNESS``:
convolutions, embeddings). ``fused`` adds phalanx's batched layers (``rules.SPEED``) and runs
a plain ``Sequential`` MLP as one autograd node (``_fused_mlp``). The stack's own module is
called on every call, so hooks, attributes and modes changed at any time are seen.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call, vmap

from phalanx import _torch_compat as compat
from phalanx._errors import summary
from phalanx._torch_compat import pytree
from phalanx.backends import BackendRefusal, _recompute
from phalanx.backends._keywords import member_kwargs
from phalanx.backends._outputs import OpaqueOutput, refuse_opaque
from phalanx.backends._state import hooked, put_back, snapshot, stored_tensors, written
from phalanx.backends.rules import CORRECTNESS, EXPORT, BatchedOps, Route, deferred

if TYPE_CHECKING:
    from phalanx.backends import StackView


def vmapped(
    view: StackView,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    in_dims: tuple[int | None, ...],
    rules: dict[Any, Route],
    name: str,
    kw_dims: frozenset[str] = frozenset(),
) -> Any:
    """Runs the stack's module under vmap with ``rules`` routed; outputs ``(N, ...)``.

    Under ``torch.compile`` this runs eagerly, outside the graph (TorchDynamo cannot trace a
    custom Function's vmap rule: an internal error in torch 2.13); the captured training
    step (``phalanx.compile_step``) traces it with make_fx instead.
    """
    if torch.compiler.is_compiling() and not torch.compiler.is_exporting():
        return _eager(view, args, kwargs, in_dims, rules, name, kw_dims)
    hooks = hooked(view.module)
    if hooks:
        # A hook runs once per member in the loop, on that member's tensors; under vmap it
        # would run once, on all members' batched tensors, and what it keeps would escape.
        where = "global module hooks" if hooks[0] == "*" else f"hooks on {hooks[0]!r}"
        _refuse(name, f"the member holds {where}, which must run once per member")
    if torch.compiler.is_exporting():
        rules = {**rules, **EXPORT}
    params, buffers = view.state()
    before = snapshot(view.module)
    # Non-tensor outputs (a None field, a flag) are the same for every member: one trace
    # computes them. vmap returns tensors only, so they travel beside it.
    layout: dict[str, Any] = {}

    shared_kwargs = {k: v for k, v in kwargs.items() if k not in kw_dims}
    per_member_kwargs = {k: kwargs[k] for k in kw_dims}

    # Each member's dropout rates, put on the modules as 0-d tensors batched over the
    # members (``_rates``; ``rules._dropout`` draws with them).
    rates = view.rates
    device = next(iter(params.values()), next(iter(buffers.values()), None))
    member_rates = (
        rates.device_rates(device.device if device is not None else torch.device("cpu"))
        if rates is not None
        else {}
    )

    def member(
        params: dict, buffers: dict, own_kwargs: dict, own_rates: dict, *member_args: Any
    ) -> tuple[torch.Tensor, ...]:
        member_kwargs = {**shared_kwargs, **own_kwargs} if own_kwargs else kwargs
        with rates.put(own_rates) if rates is not None else contextlib.nullcontext():
            out = functional_call(view.module, (params, buffers), member_args, member_kwargs)
        leaves, spec = pytree.tree_flatten(out)
        refuse_opaque(leaves, "Stack.forward()")
        layout["spec"] = spec
        layout["leaves"] = [_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]
        return tuple(t for t in leaves if isinstance(t, torch.Tensor))

    failure: BaseException | None = None
    try:
        with (
            BatchedOps(rules, view.module),
            _recompute.seen(_recompute.refuse_under_vmap),
            deferred(),
        ):
            tensors = vmap(member, in_dims=(0, 0, 0, 0, *in_dims), randomness="different")(
                params, buffers, per_member_kwargs, member_rates, *args
            )
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
        put_back(stored_tensors(before))
        failure = e
    if isinstance(failure, (OpaqueOutput, BackendRefusal)):
        raise failure  # the output itself (no backend can stack it), or a rule's refusal
    if failure is not None:
        # Outside the except block: a member's own error is raised as the loop raises it,
        # not as one that happened while handling torch.func's.
        # What only torch.func cannot do (a checkpoint, a Python value of the data, random
        # numbers it may not draw) the members alone can: no need to run them to find out,
        # and not running them leaves the random streams as the refused attempt left them.
        own = (
            None if _vmap_only(failure) else members_own_error(view, args, kwargs, in_dims, kw_dims)
        )
        if own is not None:
            raise own
        _refuse(name, _why(failure), failure)
    stored = stored_tensors(before)
    if stored:
        put_back(stored)
        module, key, _ = stored[0]
        _refuse(
            name,
            f"the member's forward stores a tensor on {type(module).__name__} as {key!r} "
            f"(state kept between calls), which one vmapped call cannot keep per member",
        )
    it = iter(tensors)
    leaves = [next(it) if leaf is _TENSOR else leaf for leaf in layout["leaves"]]
    return pytree.tree_unflatten(leaves, layout["spec"])


_TENSOR = object()
"""Marks where a tensor output goes among the non-tensor ones (None included)."""


def _why(e: BaseException) -> str:
    """torch.func's reason for a failure that the members alone do not raise."""
    why = summary(e)
    if _recompute.is_checkpoint_failure(e):
        why = _recompute.WHY_VMAP
    if any(k in why for k in ("data-dependent", ".item()", "tolist", "Python value")):
        why = (
            "the member's forward turns its data into a Python value (a branch on a "
            "tensor, .item(), int(), tolist()), which one call for all members cannot "
            f"decide member by member (torch.func says: {why})"
        )
    return why


_VMAP_ONLY = ("data-dependent", ".item()", "tolist", "Python value", "randomness")


def _vmap_only(e: BaseException) -> bool:
    """Whether ``e`` is a limit of torch.func's (not an error a member raises alone)."""
    return _recompute.is_checkpoint_failure(e) or any(k in str(e) for k in _VMAP_ONLY)


def members_own_error(
    view: StackView,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    in_dims: tuple[int | None, ...],
    kw_dims: frozenset[str],
) -> BaseException | None:
    """The error a member raises alone on this call (the loop's error), or None.

    Called where the vmapped call failed, to tell a member's own error (a batch of one in
    BatchNorm, a wrong feature size, a dtype) from what torch.func cannot batch. Each member
    runs alone on copies of its tensors and inputs, with the modules' attributes put back
    afterwards: nothing the stack or the caller holds is changed. The random streams are not
    put back (rewinding the global stream would replay another thread's draws); the draws of
    this diagnosis are spent, as those of ``auto``'s refused attempt are. The
    error is returned as the member raised it, with a note naming the member and the
    submodule it came from. None while a trace runs (no values to run on).
    """
    if compat.tracing():
        return None
    params, buffers = view.state()
    paths = {id(m): p for p, m in view.module.named_modules()}
    # Inside the caller's torch.func transform (jacrev of the stack) a copy cannot be made a
    # leaf that requires grad (torch.func refuses requires_grad_ there); the member's own
    # errors do not depend on it but for in-place writes of leaves, which the transform's
    # wrapped tensors do not forbid either.
    leaves = not (compat.transforms_active() or compat.forward_ad_active())

    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        c = t.detach().clone()
        return c.requires_grad_() if leaves and t.requires_grad and c.is_floating_point() else c

    for i in range(view.num_members):
        state = {k: copy(v[i]) for k, v in params.items()}
        state.update({k: copy(v[i]) for k, v in buffers.items()})
        member_args = pytree.tree_map(
            copy, tuple(a[i] if d == 0 else a for a, d in zip(args, in_dims))
        )
        member_kw = pytree.tree_map(copy, member_kwargs(kwargs, kw_dims, i))
        before = snapshot(view.module)
        own_rates = view.rates.put(view.rates.of(i)) if view.rates is not None else None
        try:
            with own_rates or contextlib.nullcontext():
                functional_call(view.module, state, member_args, member_kw)
        except Exception as e:
            note = f"(raised by member {i}'s own forward{_where(e, paths)}, as backend='loop' raises it)"
            if sys.version_info >= (3, 11):
                e.add_note(note)
            else:  # BaseException.add_note is 3.11's; 3.10 keeps the note where 3.11 puts it
                e.__notes__ = [*getattr(e, "__notes__", []), note]
            return e
        finally:
            put_back(list(written(before)))
    return None


def _where(e: BaseException, paths: dict[int, str]) -> str:
    """`` in submodule 'enc.0' (Linear(...))``: the innermost of the member's modules whose
    code the traceback passes through."""
    found = None
    tb = e.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in paths:
            found = owner
        tb = tb.tb_next
    if found is None:
        return ""
    path = paths[id(found)]
    extra = found.extra_repr()
    return f" in {repr(path) if path else 'the root module'} ({type(found).__name__}({extra}))"


@torch.compiler.disable
def _eager(*args: Any) -> Any:
    return vmapped(*args)


def _refuse(name: str, why: str, cause: BaseException | None = None) -> None:
    refusal = BackendRefusal(
        f"Stack.forward(): backend {name!r} cannot run this architecture under "
        f"torch.func.vmap: {why}\nUse phalanx.stack(models, backend='loop'), or "
        f"backend='auto', which hands over to the loop by itself."
    )
    refusal.why = why  # type: ignore[attr-defined]
    raise refusal from cause


class VmapBackend:
    """torch.func's recipe, with phalanx's rules where torch.func's are not exact."""

    name = "vmap"

    def forward(
        self,
        view: StackView,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: tuple[int | None, ...],
        kw_dims: frozenset[str] = frozenset(),
    ) -> Any:
        if torch.is_autocast_enabled("cpu"):
            # torch.func.vmap runs the member in float32 under CPU autocast, where the member
            # alone computes in the autocast dtype: not the loop's answer.
            raise BackendRefusal(
                "Stack.forward(): backend 'vmap' cannot run under CPU autocast: torch.func.vmap "
                "computes the member in float32 there, the member alone in the autocast dtype. "
                "Use backend='fused' or backend='loop', or backend='auto', which hands over by "
                "itself."
            )
        return vmapped(view, args, kwargs, in_dims, CORRECTNESS, self.name, kw_dims)


BACKEND = VmapBackend()
