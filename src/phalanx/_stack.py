"""``Stack``: N members of one architecture held as one module with stacked tensors."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from phalanx._backends import CHOICES, StackView, get_backend
from phalanx._layout import to_member_format
from phalanx._memory import reuse_freed_memory
from phalanx._modules import copy_modes
from phalanx._validate import architecture_differences, as_module_list, check_same_architecture
from phalanx._warnings import check_inputs, record_outputs

_CHOICES = CHOICES
InDims = int | None | Sequence[int | None]


def _swap_in(module: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]):
    """Replaces ``module``'s parameters and buffers by name, keeping tied tensors tied."""
    by_id: dict[int, torch.Tensor] = {}
    for name, p in module.named_parameters():
        by_id[id(p)] = nn.Parameter(params[name], requires_grad=p.requires_grad)
    for name, b in module.named_buffers():
        by_id[id(b)] = buffers[name]
    for sub in module.modules():
        for leaf, old in sub._parameters.items():
            if old is not None:
                sub._parameters[leaf] = by_id[id(old)]  # type: ignore[assignment]
        for leaf, old_buffer in sub._buffers.items():
            if old_buffer is not None:
                sub._buffers[leaf] = by_id[id(old_buffer)]


class Stack(nn.Module):
    """N members of one architecture, run as one computation.

    The stack holds every member's parameters and buffers stacked along a new dim 0, the
    member axis, in ``stack.module``: a copy of member 0 whose tensors have shape
    ``(N, *shape)``. These stacked tensors are the one source of truth; backends read them and
    switching backend never copies weights. ``stack.parameters()`` are leaf ``nn.Parameter``
    objects, so any ``torch.optim`` optimizer trains all members at once. Functions that
    treat the parameters as one vector do not know the member axis:
    ``torch.nn.utils.clip_grad_norm_(stack.parameters())`` clips all members by one joint
    norm; ``phalanx.clip_grad_norm_`` clips each member by its own.

    Build one with :func:`phalanx.stack`.

    Attributes:
        module: member 0's architecture holding the stacked tensors. Do not call it directly:
            its tensors carry the member axis.
        num_members: N.
    """

    num_members: int
    _template: nn.Module
    _view: StackView

    def __init__(self, models: Sequence[nn.Module] | nn.ModuleList, *, backend: str = "auto"):
        super().__init__()
        where = "phalanx.stack()"
        members = as_module_list(models, where)
        check_same_architecture(members, where)
        _check_backend(backend, where)
        with torch.no_grad():
            params = {
                name: torch.stack([m.get_parameter(name).detach() for m in members])
                for name, _ in members[0].named_parameters()
            }
            buffers = {
                name: torch.stack([m.get_buffer(name) for m in members])
                for name, _ in members[0].named_buffers()
            }
        self._setup(members[0], params, buffers, len(members), backend)

    @classmethod
    def _from_stacked(
        cls,
        member: nn.Module,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        num_members: int,
        *,
        backend: str = "auto",
    ) -> Stack:
        """A stack over tensors that are already stacked, ``(N, *shape)`` each, without copies.

        ``member`` gives the architecture (its own tensors are never read; it may live on
        ``meta``); ``params`` and ``buffers`` are keyed as ``member.named_parameters()`` and
        ``member.named_buffers()`` and become the stack's tensors as they are.
        """
        _check_backend(backend, "phalanx.stack()")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(member, params, buffers, num_members, backend)
        return self

    def _setup(
        self,
        member: nn.Module,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        num_members: int,
        backend: str,
    ) -> None:
        self.num_members = num_members
        template = meta_copy(member)
        object.__setattr__(self, "_template", template)
        self.module = copy.deepcopy(template)  # deepcopy keeps member 0's train/eval modes
        _swap_in(self.module, params, buffers)
        self.training = self.module.training
        self._param_slots = [_slot(self.module, name) for name, _ in self.module.named_parameters()]
        self._buffer_slots = [_slot(self.module, name) for name, _ in self.module.named_buffers()]
        object.__setattr__(
            self, "_view", StackView(num_members, self.module, template, self._stacked_state)
        )
        self._set_backend(backend)
        cpu = [t for t in [*params.values(), *buffers.values()] if t.device.type == "cpu"]
        if cpu:  # gradients of this size would be mapped and faulted in afresh every step
            reuse_freed_memory(max(t.numel() * t.element_size() for t in cpu))

    def _set_backend(self, name: str) -> None:
        get_backend(name)  # imported now, not inside a torch.compile trace of the first call
        self._requested = name
        self._view.cache.clear()  # what backends learnt about the old choice

    # ----------------------------------------------------------------------------------- state

    def __len__(self) -> int:
        return self.num_members

    def _stacked_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The stacked parameters and buffers by name, each ``(N, *shape)``."""
        try:
            params = {name: owner._parameters[leaf] for name, owner, leaf in self._param_slots}
            buffers = {name: owner._buffers[leaf] for name, owner, leaf in self._buffer_slots}
        except KeyError as e:
            raise RuntimeError(
                f"phalanx: the stack's tensor {e.args[0]!r} is gone from its module: the module "
                f"tree was changed after phalanx.stack() (weight_norm, a parametrization, a "
                f"replaced submodule). Change the members before stacking them, e.g. "
                f"phalanx.stack([weight_norm(m) for m in models])."
            ) from None
        if any(p is None for p in params.values()):
            raise RuntimeError(
                "phalanx: a stacked parameter of the stack's module was set to None after "
                "phalanx.stack(); change the members before stacking them."
            )
        return params, buffers  # type: ignore[return-value]

    def apply(self, fn: Callable[[nn.Module], None]) -> Stack:
        """Calls ``fn`` on every submodule of each member in turn, as on N separate modules.

        ``stack.apply(init_fn)`` initialises each member as ``init_fn`` initialises one
        module: a fan-in is the member's own, not that of the stacked ``(N, out, in)`` tensor
        (``nn.Module.apply`` on the stacked tensors would get it wrong). What ``fn`` writes
        into parameters and buffers is kept; other changes it makes are not.
        """
        params, buffers = self._stacked_state()
        with torch.no_grad():
            for i in range(self.num_members):
                member = self._member_module(i)
                member.apply(fn)
                for name, p in params.items():
                    p[i].copy_(member.get_parameter(name))
                for name, b in buffers.items():
                    b[i].copy_(member.get_buffer(name))
        return self

    def to(self, *args: Any, **kwargs: Any) -> Stack:
        """``nn.Module.to``, with ``memory_format`` applied to each member's tensors.

        ``stack.to(memory_format=torch.channels_last)`` lays out every member's conv weight
        as ``member.to(memory_format=torch.channels_last)`` would: ``stack.parameters()``
        stay the same objects, holding the same values (``phalanx._layout``).
        """
        memory_format = kwargs.pop("memory_format", None)
        if args or kwargs:
            super().to(*args, **kwargs)
        if memory_format is not None:
            to_member_format(self.module, memory_format)
        return self

    @property
    def backend(self) -> str:
        """The backend in use: "fused", "vmap" or "loop".

        With ``backend="auto"`` this is the backend ``auto`` runs in the current grad mode
        (before the first call, the one it will try first; a backend that turns out not to
        run the model exactly is dropped, with a warning). Assign a name to switch; no
        weights are copied.
        """
        if self._requested != "auto":
            return self._requested
        return get_backend("auto").current(self._view)  # type: ignore[attr-defined]

    @backend.setter
    def backend(self, name: str) -> None:
        _check_backend(name, "Stack.backend")
        self._set_backend(name)

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}, backend={self._requested!r}"

    # --------------------------------------------------------------------------------- forward

    def forward(self, *args: Any, in_dims: InDims = None, **kwargs: Any) -> Any:
        """Runs every member on its input and stacks the outputs along dim 0.

        Args:
            *args: the member's positional inputs. A shared input ``(B, ...)`` is seen by every
                member; a per-member input ``(N, B, ...)`` gives member i ``x[i]``.
            in_dims: per positional input, ``None`` (shared) or ``0`` (per-member), as in
                ``torch.func.vmap``; a single value applies to every input.
            **kwargs: keyword inputs, shared by every member.

        Returns:
            The members' outputs stacked on a new dim 0: ``(N, B, ...)`` for a tensor output;
            tuples and dicts of tensors keep their structure with stacked leaves.

        Raises:
            ValueError: a per-member input does not have N as its first dimension.

        Example:
            >>> stack = phalanx.stack([nn.Linear(4, 2) for _ in range(3)])
            >>> stack(torch.randn(5, 4)).shape
            torch.Size([3, 5, 2])
        """
        dims = self._normalize_in_dims(in_dims, args)
        self._check_devices(args, kwargs)
        backend = get_backend(self._requested)
        if torch.compiler.is_compiling():
            return backend.forward(self._view, args, kwargs, dims)
        check_inputs(self._view, args, dims)  # a fed-back output, a shared x requiring grad
        # Every backend runs the stack's one module tree with each call's tensors swapped in
        # (torch.func.functional_call), so two threads must not run it at once.
        with self._view.lock:
            return record_outputs(self._view, backend.forward(self._view, args, kwargs, dims))

    def _normalize_in_dims(self, in_dims: InDims, args: tuple[Any, ...]) -> tuple[int | None, ...]:
        where = "Stack.forward()"
        if in_dims is None or isinstance(in_dims, int):
            dims: tuple[int | None, ...] = (in_dims,) * len(args)
        else:
            dims = tuple(in_dims)
            if len(dims) != len(args):
                raise ValueError(
                    f"{where}: in_dims has {len(dims)} entries but {len(args)} positional inputs "
                    f"were given; give one None (shared) or 0 (per-member) per input."
                )
        for k, (a, d) in enumerate(zip(args, dims)):
            if d is None:
                continue
            if d != 0 or isinstance(d, bool):
                raise ValueError(
                    f"{where}: in_dims entries must be None (shared) or 0 (per-member); input {k} "
                    f"has {d!r}. Move the member axis first with x.movedim({d}, 0)."
                )
            if not isinstance(a, torch.Tensor):
                raise TypeError(
                    f"{where}: input {k} is marked per-member (in_dims=0) but is a "
                    f"{type(a).__name__}, not a tensor; mark it None to share it."
                )
            if a.dim() == 0 or a.shape[0] != self.num_members:
                n = self.num_members
                raise ValueError(
                    f"{where}: with in_dims=0 the input's first dimension must be the number of "
                    f"members, {n}; got a tensor of shape {tuple(a.shape)}"
                    + (f" (input {k})" if len(args) > 1 else "")
                    + f". For one wide input sliced across members, use "
                    f"phalanx.split(x, {n}, dim=1); for an input shared by all members, drop "
                    f"in_dims."
                )
        return dims

    def _check_devices(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Refuses ``meta`` inputs to a stack holding data: no backend computes them truly."""
        meta = [
            k
            for k, a in [*enumerate(args), *kwargs.items()]
            if isinstance(a, torch.Tensor) and a.is_meta
        ]
        first = next(iter(self._stacked_state()[0].values()), None) if meta else None
        if first is None or first.is_meta:
            return
        raise ValueError(
            f"Stack.forward(): input {meta[0]!r} is on the meta device, the stack's parameters "
            f"on {first.device}; move the input with x.to({str(first.device)!r}), or the "
            f"stack with stack.to('meta') to trace shapes only."
        )

    # ---------------------------------------------------------------------------------- export

    def unstack(self) -> list[nn.Module]:
        """Returns N ordinary modules holding the members' current weights and buffers.

        The modules are independent copies (no memory is shared with the stack), on the
        stack's device and dtype, in the stack's train/eval mode.

        Example:
            >>> models = stack.unstack()
            >>> models[2](x)  # equals stack(x)[2]
        """
        return [self._member_module(i) for i in range(self.num_members)]

    def _member_module(self, i: int) -> nn.Module:
        params, buffers = self._stacked_state()
        member = copy.deepcopy(self._template)
        with torch.no_grad():
            _swap_in(
                member,
                {k: v[i].detach().clone() for k, v in params.items()},
                {k: v[i].clone() for k, v in buffers.items()},
            )
        copy_modes(self.module, member)
        return member

    def copy_to(self, models: Sequence[nn.Module] | nn.ModuleList) -> None:
        """Writes every member's current weights and buffers into existing modules, in place.

        Args:
            models: N modules of the members' architecture, e.g. the list the stack was built
                from. Their devices may differ from the stack's; shapes and dtypes must match.

        Raises:
            ValueError: a different number of modules, or one whose architecture differs.
        """
        where = "Stack.copy_to()"
        targets = as_module_list(models, where)
        if len(targets) != self.num_members:
            raise ValueError(
                f"{where}: the stack has {self.num_members} members but {len(targets)} modules "
                f"were given; pass exactly one module per member."
            )
        reference = self._member_module(0)
        diffs = [
            d
            for i, m in enumerate(targets)
            for d in architecture_differences(
                reference, m, i, ref_name="the stack", check_device=False, check_mode=False
            )
        ]
        if diffs:
            raise ValueError(
                f"{where}: the modules do not match the stack's architecture:\n  - "
                + "\n  - ".join(diffs)
            )
        params, buffers = self._stacked_state()
        with torch.no_grad():
            for i, m in enumerate(targets):
                for name, p in params.items():
                    m.get_parameter(name).copy_(p[i])
                for name, b in buffers.items():
                    m.get_buffer(name).copy_(b[i])


def _check_backend(name: str, where: str) -> None:
    if name not in _CHOICES:
        raise ValueError(
            f"{where}: unknown backend {name!r}; choose one of "
            + ", ".join(repr(c) for c in _CHOICES)
            + "."
        )


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s structure whose parameters and buffers live on ``meta``.

    No tensor data is copied, and tensors tied within the module (one parameter object used
    by two submodules) stay tied in the copy.
    """
    memo: dict[int, Any] = {}
    for _, p in module.named_parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for _, b in module.named_buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def _slot(module: nn.Module, name: str) -> tuple[str, nn.Module, str]:
    owner_path, _, leaf = name.rpartition(".")
    return name, module.get_submodule(owner_path), leaf


def stack(
    models: Sequence[nn.Module] | nn.ModuleList | Callable[..., nn.Module],
    *,
    backend: str = "auto",
    num_members: int | None = None,
    seed: int | None = 0,
    device: torch.device | str | None = None,
) -> Stack:
    """Stacks N modules of one architecture into one :class:`Stack`.

    The members' parameters and buffers are copied into stacked tensors ``(N, *shape)``; the
    original modules are left untouched (use :meth:`Stack.copy_to` to write results back).

    Args:
        models: N >= 1 modules (a list, tuple or ``nn.ModuleList``) with the same module types,
            parameter and buffer names, shapes, dtypes, devices, train/eval mode, settings,
            hooks and ties; or a factory that builds one member (``lambda i: MLP()``), called
            N times, each member copied into the stack and dropped before the next is built,
            so that memory never holds two copies of the weights.
        backend: "auto" (the fastest backend that runs the architecture exactly, announced
            when it has to fall back), "fused", "vmap" or "loop" (member by member: the
            reference).
        num_members: with a factory, N.
        seed: with a factory, member i is built right after ``torch.manual_seed(seed + i)``,
            so its weights are those of ``torch.manual_seed(seed + i); factory(i)``; None
            leaves seeding to the factory.
        device: with a factory, where the stacked tensors live.

    Returns:
        The stack, an ``nn.Module``.

    Raises:
        TypeError: ``models`` is not a sequence of modules.
        ValueError: no members, an unknown backend, or members that differ; every
            difference is listed at once.

    Example:
        >>> models = [nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)) for _ in range(8)]
        >>> stack = phalanx.stack(models)
        >>> stack(torch.randn(32, 10)).shape
        torch.Size([8, 32, 2])
    """
    if callable(models) and not isinstance(models, nn.Module):
        from phalanx._build import stack_from_factory

        if num_members is None:
            raise TypeError(
                "phalanx.stack(): a factory needs num_members=N, the number of members to "
                "build, e.g. phalanx.stack(lambda i: MLP(), num_members=8)."
            )
        return stack_from_factory(
            models, num_members=num_members, seed=seed, backend=backend, device=device
        )
    models = cast("Sequence[nn.Module] | nn.ModuleList", models)
    if num_members is not None and num_members != len(models):
        raise ValueError(
            f"phalanx.stack(): num_members={num_members} but {len(models)} modules were given; "
            f"drop num_members when passing modules."
        )
    return Stack(models, backend=backend)
