"""``stack_in_place``: an ``nn.ModuleList`` inside a model replaced by a stack that still acts
as the list did.

Real code keeps its members inside a model (``model.heads``, ``block.experts``, one network
per feature), whose forward indexes or iterates the list and whose checkpoints were written
with the list's keys (``heads.0.weight``, shape ``(out, in)``). :func:`stack_in_place` swaps
the list for a :class:`StackedModuleList`: a :class:`phalanx.Stack` (``model.heads(x)`` runs
every member at once, ``(N, B, ...)``) that also indexes, iterates and has a length as the list
did, and whose ``state_dict`` keys and shapes are the list's, so existing checkpoints load and
Hugging Face ``save_pretrained`` files stay loadable by the unstacked model.

The keys are translated by torch's public state-dict hooks: ``register_state_dict_post_hook``
writes each stacked tensor ``module.<name>`` ``(N, *shape)`` as ``<i>.<name>`` ``(*shape)``
(copies, so that files never hold tensors sharing memory), and
``register_load_state_dict_pre_hook`` copies ``<i>.<name>`` into member i's slice.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from phalanx import _torch_compat as compat
from phalanx.core._stack import Stack
from phalanx.core._validate import architecture_differences

_WHERE = "phalanx.stack_in_place()"


class _Slices:
    """The members' slices of the stacked tensors, one ``unbind`` per tensor, reused while the
    tensors are unchanged: a loop ``[h(x) for h in model.heads]`` then builds one autograd node
    per tensor instead of one zero-padded gradient per member. Never copied with the module."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.slices: dict[str, tuple[torch.Tensor, ...]] = {}

    def __deepcopy__(self, memo: dict) -> _Slices:
        return _Slices()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]


class StackedModuleList(Stack):
    """A :class:`phalanx.Stack` that stands where an ``nn.ModuleList`` of its members stood.

    Build one with :func:`stack_in_place`. Besides the stack's own call (``heads(x)`` runs all
    members at once and returns ``(N, B, ...)``), it behaves as the list did for the code
    around it:

    - ``len(heads)``, ``heads[i]`` (negative indices too), ``heads[a:b]``, ``for h in heads``:
      member views, whose forward runs member i alone on its slice of the stacked tensors
      (gradients flow into the stacked parameters) and whose parameters (``heads[i].weight``)
      are that member's slices, ``(out, in)``; ``heads[i] = module`` copies a module's weights
      into member i.
    - ``state_dict()`` keys and shapes are the list's (``heads.0.weight``, ``(out, in)``), as
      copies; ``load_state_dict`` takes them (a checkpoint written before stacking loads), and
      reports a missing or mis-shaped member under its list key.

    ``named_parameters()`` yields the stacked leaves (``heads.module.weight``, ``(N, out,
    in)``): build the optimizer after stacking. The list's length is fixed: ``append``,
    ``extend`` and ``insert`` raise (use :func:`unstack_in_place` first).
    """

    # The list's state dict is its members' (a plain module keeps p as an attribute, not a
    # tensor): the members' dropout rates stay as built, not written as keys of their own.
    _rates_in_state_dict = False

    def __init__(self, members: Sequence[nn.Module] | nn.ModuleList, *, backend: str = "auto"):
        super().__init__(members, backend=backend)
        self._slices = _Slices()
        self.register_state_dict_post_hook(_write_member_keys)
        self.register_load_state_dict_pre_hook(_read_member_keys)
        self.register_load_state_dict_post_hook(_report_member_keys)

    # ----------------------------------------------------------------------- the list's API

    def _index(self, i: int) -> int:
        n = self.num_members
        try:
            i = operator.index(i)  # as nn.ModuleList: ints, numpy ints, 0-d integer tensors
        except TypeError:
            raise TypeError(
                f"StackedModuleList: indices must be integers or slices, not {type(i).__name__}."
            ) from None
        if not -n <= i < n:
            raise IndexError(f"StackedModuleList: index {i} is out of range for {n} members.")
        return i % n

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [MemberView(self, k) for k in range(self.num_members)[i]]
        return MemberView(self, self._index(i))

    def __iter__(self) -> Iterator[MemberView]:
        return (MemberView(self, k) for k in range(self.num_members))

    def __setitem__(self, i: int, module: nn.Module) -> None:
        """Copies ``module``'s weights and buffers into member ``i`` (of the same architecture)."""
        k = self._index(i)
        reference = self._member_module(0)
        diffs = architecture_differences(
            reference, module, k, ref_name="the stack", check_device=False, check_mode=False
        )
        if diffs:
            raise ValueError(
                "StackedModuleList: the module does not match the members' architecture:\n  - "
                + "\n  - ".join(diffs)
            )
        params, buffers = self.stacked_state()
        with torch.no_grad():
            for name, p in params.items():
                p[k].copy_(module.get_parameter(name))
            for name, b in buffers.items():
                b[k].copy_(module.get_buffer(name))
        self._take_rates(k, module, "StackedModuleList[i] = module")

    def _fixed_length(self, *_: Any) -> None:
        """Refused: a stacked list holds a fixed number of members (``append``, ``extend`` and
        ``insert`` raise a TypeError that says how to change it)."""
        raise TypeError(
            f"StackedModuleList: the number of members is fixed at {self.num_members}; to "
            f"change it, turn the list back with phalanx.unstack_in_place(model, path), edit "
            f"it, and stack it again."
        )

    append = extend = insert = _fixed_length

    # --------------------------------------------------------------------------- one member

    def member_slices(self, i: int) -> dict[str, torch.Tensor]:
        """Member ``i``'s parameters and buffers by name: slices of the stacked tensors."""
        params, buffers = self.stacked_state()
        key = (
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            tuple((id(t), t.data_ptr(), compat.version(t)) for t in params.values()),
        )
        if compat.transforms_active() or compat.forward_ad_active():
            return {**{k: v[i] for k, v in params.items()}, **{k: v[i] for k, v in buffers.items()}}
        if key != self._slices.key:
            self._slices.slices = {k: v.unbind(0) for k, v in params.items()}
            self._slices.key = key
        return {
            **{k: v[i] for k, v in self._slices.slices.items()},
            **{k: v[i] for k, v in buffers.items()},
        }

    def run_member(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Member ``i``'s forward on its own slices, as the list's module ``i`` ran it."""
        call = lambda: functional_call(self.module, self.member_slices(i), args, kwargs)  # noqa: E731
        rates = self.member_rates
        with self.call_lock:
            return call() if rates is None else rates.run(i, call)  # member i's dropout rates


class MemberView(nn.Module):
    """Member ``i`` of a :class:`StackedModuleList`, as the list's module ``i`` was.

    Calling it runs that member alone; its attributes (``view.weight``, ``view[0].bias``) and
    ``parameters()``, ``named_parameters()``, ``state_dict()`` are member i's slices of the
    stacked tensors, read when asked (a view stays valid after ``.to()`` or a checkpoint load).
    """

    def __init__(self, owner: StackedModuleList, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_member", index)
        self.training = owner.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner.run_member(self._member, args, kwargs)

    def materialize(self) -> nn.Module:
        """Member i's architecture holding its slices (views: writes reach the stack)."""
        owner = self._owner
        member = copy.deepcopy(owner.template)
        slices = owner.member_slices(self._member)
        by_id = {id(t): slices[name] for name, t in member.named_parameters()}
        by_id.update({id(t): slices[name] for name, t in member.named_buffers()})
        for sub in member.modules():  # every owner of a tied tensor gets the one slice
            for store in (compat.own_parameters(sub), compat.own_buffers(sub)):
                for leaf, t in store.items():
                    if t is not None:
                        store[leaf] = by_id[id(t)]
        member.train(owner.training)
        for path, p in owner._rates_of(self._member).items():
            member.get_submodule(path).p = p
        return member

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.materialize(), name)

    def __getitem__(self, key: Any) -> Any:  # a Sequential member: view[0] is its first layer
        return self.materialize()[key]  # type: ignore[index]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        return self.materialize().named_parameters(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        return self.materialize().named_buffers(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.materialize().state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"member {self._member} of {self._owner.num_members}"


# ---------------------------------------------------------------------------- state dict hooks


def _stacked_names(module: StackedModuleList) -> list[str]:
    params, buffers = module.stacked_state()
    saved = set(module.module.state_dict(keep_vars=True))  # persistent buffers only
    return [*params, *(name for name in buffers if name in saved)]


def _write_member_keys(
    module: StackedModuleList, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """``<prefix>module.<name>`` ``(N, *shape)`` -> ``<prefix><i>.<name>`` ``(*shape)``."""
    stacked = {}
    for name in _stacked_names(module):
        key = f"{prefix}module.{name}"
        if key in state_dict:
            stacked[name] = state_dict.pop(key)
    for i in range(module.num_members):
        for name, t in stacked.items():
            # Copies: a file format (safetensors) refuses tensors that share memory.
            state_dict[f"{prefix}{i}.{name}"] = t[i].clone() if not t.requires_grad else t[i]
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if k.startswith(f"{prefix}module")]:
            del metadata[key]


def _read_member_keys(
    module: StackedModuleList,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Copies ``<prefix><i>.<name>`` into member i's slice of ``<prefix>module.<name>``."""
    params, buffers = module.stacked_state()
    tensors = {**params, **buffers}
    absent: dict[str, list[str]] = {}
    with torch.no_grad():
        for name in _stacked_names(module):
            if f"{prefix}module.{name}" in state_dict:
                continue  # a stacked tensor (N, *shape): torch loads it as it is
            target = tensors[name]
            absent[name] = []
            for i in range(module.num_members):
                key = f"{prefix}{i}.{name}"
                if key not in state_dict:
                    absent[name].append(key)
                    continue
                value = state_dict.pop(key)
                if not isinstance(value, torch.Tensor) or value.shape != target.shape[1:]:
                    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                    error_msgs.append(
                        f"size mismatch for {key}: copying a param with shape {shape} from "
                        f"checkpoint, the shape in current model is {tuple(target.shape[1:])}."
                    )
                    continue
                target[i].copy_(value)
    object.__setattr__(module, "_absent", (prefix, absent))


def _report_member_keys(module: StackedModuleList, incompatible: Any) -> None:
    """Names what was missing by the list's keys, not the stacked ones torch looked for."""
    prefix, absent = module.__dict__.pop("_absent", ("", {}))
    missing = incompatible.missing_keys
    for name, keys in absent.items():
        stacked = f"{prefix}module.{name}"
        if stacked in missing:
            at = missing.index(stacked)
            missing[at : at + 1] = keys


def stack_in_place(model: nn.Module, path: str, *, backend: str = "auto") -> StackedModuleList:
    """Replaces the ``nn.ModuleList`` at ``model.<path>`` by a stack of its members, in place.

    The code around the list keeps working unchanged (``heads[i]``, ``for h in heads``,
    ``len(heads)``, the list's ``state_dict`` keys), and ``model.<path>(x)`` now runs every
    member at once, returning ``(N, B, ...)`` (see :class:`StackedModuleList`). The members'
    weights move into the stack; the list's modules are no longer part of the model.

    Args:
        model: the model holding the list.
        path: where the list is, as in ``model.get_submodule`` (``"heads"``,
            ``"encoder.block.experts"``).
        backend: the stack's backend, as for :func:`phalanx.stack`.

    Returns:
        The :class:`StackedModuleList` now at ``model.<path>``.

    Raises:
        TypeError: there is no ``nn.ModuleList`` at ``path``.
        ValueError: the list's modules differ in architecture (every difference listed).

    Example:
        >>> model = nn.Module()
        >>> model.heads = nn.ModuleList([nn.Linear(4, 2) for _ in range(3)])
        >>> heads = phalanx.stack_in_place(model, "heads")
        >>> heads(torch.randn(5, 4)).shape, len(heads), heads[0].weight.shape
        (torch.Size([3, 5, 2]), 3, torch.Size([2, 4]))
        >>> sorted(model.state_dict())[:2]
        ['heads.0.bias', 'heads.0.weight']
    """
    parent_path, _, leaf = path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path)
        found = parent.get_submodule(leaf)
    except AttributeError as e:
        raise TypeError(f"{_WHERE}: the model has no submodule {path!r} ({e}).") from None
    if isinstance(found, StackedModuleList):
        raise TypeError(f"{_WHERE}: {path!r} is stacked already.")
    if not isinstance(found, nn.ModuleList):
        raise TypeError(
            f"{_WHERE}: {path!r} is a {type(found).__name__}, not an nn.ModuleList. Only a list "
            f"of independent members can be stacked in place (an nn.Sequential feeds each "
            f"module the previous one's output); for other modules use phalanx.stack(models)."
        )
    stacked = StackedModuleList(found, backend=backend)
    setattr(parent, leaf, stacked)
    return stacked


def unstack_in_place(model: nn.Module, path: str) -> nn.ModuleList:
    """Turns the stack at ``model.<path>`` back into an ``nn.ModuleList`` of ordinary modules
    holding the members' current weights (the inverse of :func:`stack_in_place`)."""
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    found = parent.get_submodule(leaf)
    if not isinstance(found, StackedModuleList):
        raise TypeError(
            f"phalanx.unstack_in_place(): {path!r} is a {type(found).__name__}, not a stack "
            f"made by phalanx.stack_in_place()."
        )
    modules = nn.ModuleList(found.unstack())
    setattr(parent, leaf, modules)
    return modules
