"""``Stack``: N members of one architecture held as one module with stacked tensors."""

from __future__ import annotations

import contextlib
import copy
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, overload

import torch
from torch import nn
from typing_extensions import Self, TypeVar

from phalanx import _torch_compat as compat
from phalanx._module_tree import copy_modes, meta_copy, unshare_submodules
from phalanx.backends import CHOICES, StackView, get_backend
from phalanx.backends._keywords import KwInDims, keyword_dims
from phalanx.backends._memory import reuse_freed_memory
from phalanx.backends._random import MemberGenerators, copy_generators, generator_slots
from phalanx.backends._rates import MemberRates, check_rate, collect_rates, has_member_p
from phalanx.backends._state import PerMemberAttributes, RemappedAttributes
from phalanx.core._chunks import ChunkInputs
from phalanx.core._hf import check_call, guard_stacked
from phalanx.core._input_warnings import check_inputs, record_outputs, record_ranks
from phalanx.core._memory_format import to_member_format
from phalanx.core._validate import (
    architecture_differences,
    as_module_list,
    check_materialised,
    check_same_architecture,
)
from phalanx.core._widths import (
    WIDTHS_KEY,
    Padding,
    check_loaded_widths,
    mask_gradients,
    member_shapes,
    pad_members,
)
from phalanx.routed import _routed

InDims = int | None | Sequence[int | None]
# What ``stack(...)`` returns, for type checkers: a tensor unless the stack is annotated
# otherwise, e.g. ``stack: phalanx.Stack[ModelOutput]`` for a Hugging Face model.
Out = TypeVar("Out", default=torch.Tensor)


def _swap_in(
    module: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
) -> Any:
    """Replaces ``module``'s parameters and buffers by name, keeping tied tensors tied."""
    by_id: dict[int, torch.Tensor] = {}
    for name, p in module.named_parameters():
        by_id[id(p)] = nn.Parameter(params[name], requires_grad=p.requires_grad)
    for name, b in module.named_buffers():
        by_id[id(b)] = buffers[name]
    for sub in module.modules():
        own_params, own_buffers = compat.own_parameters(sub), compat.own_buffers(sub)
        for leaf, old in own_params.items():
            if old is not None:
                own_params[leaf] = by_id[id(old)]
        for leaf, old_buffer in own_buffers.items():
            if old_buffer is not None:
                own_buffers[leaf] = by_id[id(old_buffer)]


_LIVE: weakref.WeakSet[Stack[Any]] = weakref.WeakSet()


def live_stacks() -> list[Stack[Any]]:
    """The stacks alive in this process: integrations that are given bare parameters
    (``accelerator.clip_grad_norm_``) find with it whether they belong to a stack."""
    return list(_LIVE)


class Stack(nn.Module, Generic[Out]):
    """N members of one architecture, run as one computation.

    The stack holds every member's parameters and buffers stacked along a new dim 0, the
    member axis, in ``stack.module``: a copy of member 0 whose tensors have shape
    ``(N, *shape)``. These stacked tensors are the one source of truth; backends read them and
    switching backend never copies weights. ``stack.parameters()`` are leaf ``nn.Parameter``
    objects, so any ``torch.optim`` optimizer trains all members at once. Functions that
    treat the parameters as one vector do not know the member axis:
    ``torch.nn.utils.clip_grad_norm_(stack.parameters())`` clips all members by one joint
    norm; ``phalanx.clip_grad_norm_`` clips each member by its own.

    ``stack[i]`` is member i as an ordinary module of its own class (a copy: see
    :meth:`__getitem__`); ``stack[i] = module`` writes a module's weights into member i.

    For type checkers ``stack(x)`` returns a ``torch.Tensor``; a stack whose members return
    something else (a tuple, a Hugging Face ``ModelOutput``) is annotated with it:
    ``stack: phalanx.Stack[ModelOutput] = phalanx.stack(models)``.

    Build one with :func:`phalanx.stack`.

    Attributes:
        module: member 0's architecture holding the stacked tensors. Do not call it directly:
            its tensors carry the member axis.
        num_members: N.
    """

    num_members: int
    _template: nn.Module
    _view: StackView
    _rates_in_state_dict = True  # the members' dropout rates as ``dropout_rates.<path>`` keys

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # Every stack, copies and unpickled ones included, for live_stacks().
        self = super().__new__(cls)
        _LIVE.add(self)
        return self

    def __init__(
        self,
        models: Sequence[nn.Module] | nn.ModuleList,
        *,
        backend: str = "auto",
        pad_widths: bool = False,
    ):
        super().__init__()
        where = "phalanx.stack()"
        members = as_module_list(models, where)
        check_materialised(members, where)
        if pad_widths:
            _check_backend(backend, where)
            member, params, buffers, padding = pad_members(members)
            slots = generator_slots(members[0])  # each member draws from its own, as unpadded
            generators = copy_generators(members, slots, where) if slots else None
            rates = collect_rates(members, where, reference=member)
            self._setup(
                member, params, buffers, len(members), backend, padding, generators, rates=rates
            )
            return
        check_same_architecture(members, where)
        rates = collect_rates(members, where)  # a dropout rate per member (backends/_rates)
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
        slots = generator_slots(members[0])
        generators = copy_generators(members, slots, where) if slots else None
        self._setup(
            members[0], params, buffers, len(members), backend, generators=generators, rates=rates
        )

    @classmethod
    def from_stacked(
        cls,
        member: nn.Module,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        num_members: int,
        *,
        backend: str = "auto",
        padding: Padding | None = None,
        generators: list[list[torch.Generator]] | None = None,
        dropout_rates: dict[str, torch.Tensor] | None = None,
    ) -> Self:
        """A stack over tensors that are already stacked, ``(N, *shape)`` each, without copies.

        ``member`` gives the architecture (its own tensors are never read; it may live on
        ``meta``, such as another stack's :attr:`template`); ``params`` and ``buffers`` are
        keyed as ``member.named_parameters()`` and ``member.named_buffers()`` and become the
        stack's tensors as they are. ``phalanx.stack``'s factory form and
        ``phalanx.population.keep_members`` build their stacks with it. ``padding``: the
        members' own shapes where the tensors are padded to the widest (:attr:`padding`).
        Where the member holds
        ``torch.Generator`` attributes, ``generators[i]`` are member i's, in the order of
        :attr:`generator_slots` (each is used as it is, not copied); without them every member
        starts from a copy of ``member``'s. ``dropout_rates``: the members' dropout rates,
        ``(N,)`` per Dropout module path (:attr:`dropout_rates`); without them every member
        has ``member``'s.
        """
        _check_backend(backend, "phalanx.stack()")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        slots = generator_slots(member)
        if generators is None and slots:
            where = "Stack.from_stacked()"
            generators = [copy_generators([member], slots, where)[0] for _ in range(num_members)]
        self._setup(
            member, params, buffers, num_members, backend, padding, generators, dropout_rates
        )
        return self

    def _setup(
        self,
        member: nn.Module,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        num_members: int,
        backend: str,
        padding: Padding | None = None,
        generators: list[list[torch.Generator]] | None = None,
        rates: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.num_members = num_members
        self._padding = padding
        template = meta_copy(member)
        object.__setattr__(self, "_template", template)
        self.module = copy.deepcopy(template)  # deepcopy keeps member 0's train/eval modes
        # A submodule used at several places: one object per place, its tensors tied
        # (functional_call would leave a shared one holding a member's tensors).
        unshare_submodules(self.module)
        _swap_in(self.module, params, buffers)
        guard_stacked(self.module)  # a Hugging Face model's save_pretrained would write (N, ...)
        self.training = self.module.training
        self._param_slots = [_slot(self.module, name) for name, _ in self.module.named_parameters()]
        self._buffer_slots = [_slot(self.module, name) for name, _ in self.module.named_buffers()]
        object.__setattr__(
            self,
            "_view",
            StackView(
                num_members,
                self.module,
                template,
                self.stacked_state if padding is None else self._masked_state,
            ),
        )
        if generators is not None:  # each member draws from its own (backends/_random.py)
            slots = generator_slots(template)
            self._view.generators = MemberGenerators(self.module, slots, generators)
        self._view.rates = None
        for path, values in (rates or {}).items():
            self._set_rates(path, values, "phalanx.stack()")
        if self._rates_in_state_dict:
            self._register_state_dict_hook(_save_rates)
            self._register_load_state_dict_pre_hook(_load_rates, with_module=True)
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

    if TYPE_CHECKING:  # nn.Module types __call__ as returning Any

        def __call__(
            self,
            *args: Any,
            in_dims: InDims = None,
            kw_in_dims: KwInDims = None,
            members: Any = None,
            weights: Any = None,
            subset: Any = None,
            **kwargs: Any,
        ) -> Out: ...

    @overload
    def __getitem__(self, index: int) -> nn.Module: ...
    @overload
    def __getitem__(self, index: slice) -> list[nn.Module]: ...
    def __getitem__(self, index: int | slice) -> nn.Module | list[nn.Module]:
        """Member ``index`` as an ordinary module of its own class: a copy.

        ``stack[i]`` is ``stack.unstack()[i]`` without building the other members: a module
        of member i's class holding copies of its current weights, buffers and generators, in
        the stack's train/eval mode (in a stack built with ``pad_widths=True``, at its own
        widths). It shares no memory with the stack: training it or writing into it leaves the
        stack unchanged, and training the stack leaves it as it was taken. Write it back with
        ``stack[i] = module``. (A module whose parameters were views of the stacked tensors
        would get no gradient from the stack's calls and would change the stack behind its
        optimizer's back; to run member i alone inside the stack's graph use
        ``stack(x, subset=[i])``.)

        Args:
            index: an int (negative counts from the end) or a slice, which gives a list.

        Raises:
            IndexError: ``index`` is not in ``-N .. N-1``.
            TypeError: ``index`` is not an int or a slice.

        Example:
            >>> stack = phalanx.stack([nn.Linear(4, 2) for _ in range(3)])
            >>> x = torch.randn(5, 4)
            >>> torch.equal(stack[-1](x), stack(x)[2])
            True
        """
        if isinstance(index, slice):
            return [self._member_module(k) for k in range(self.num_members)[index]]
        return self._member_module(self._member_index(index, "Stack[i]"))

    def __setitem__(self, index: int, module: nn.Module) -> None:
        """Copies ``module``'s parameters and buffers into member ``index``, in place.

        The module must have the members' architecture (member ``index``'s own widths in a
        padded stack). The stack's tensors stay the same objects, so an optimizer built on
        ``stack.parameters()`` keeps stepping them; its state for the member (Adam's moments)
        is kept as it was, not reset.

        Raises:
            IndexError: ``index`` is not in ``-N .. N-1``.
            ValueError: ``module``'s architecture differs from the member's.
        """
        where = "Stack[i] = module"
        k = self._member_index(index, where)
        self._check_architecture(
            where, [(k, module)], "the module does not match the members' architecture"
        )
        self._copy_rows([(k, module)], into_stack=True)
        self._take_rates(k, module, where)

    def _check_architecture(
        self, where: str, modules: Sequence[tuple[int, nn.Module]], what: str, *, one: bool = False
    ) -> None:
        """Raises ValueError naming every difference between each ``(i, module)`` and member
        i's architecture (with ``one`` and no padding: the stack's, named "the stack").

        Args:
            where: the public call, first in the message.
            modules: (member index, module) pairs.
            what: the message's summary line, after ``where``.
            one: compare every module with one reference, member 0, where members share
                their widths.
        """
        reference = self._member_module(0) if one and self._padding is None else None
        diffs = [
            d
            for i, m in modules
            for d in architecture_differences(
                self._member_module(i) if reference is None else reference,
                m,
                i,
                ref_name=f"the stack's member {i}" if reference is None else "the stack",
                check_device=False,
                check_mode=False,
            )
        ]
        if diffs:
            raise ValueError(f"{where}: {what}:\n  - " + "\n  - ".join(diffs))

    def _copy_rows(self, modules: Sequence[tuple[int, nn.Module]], *, into_stack: bool) -> None:
        """Copies member i's rows of the stacked parameters and buffers into each ``(i,
        module)``'s own tensors, or, ``into_stack``, the module's tensors into the rows."""
        params, buffers = self.stacked_state()
        with torch.no_grad():
            for i, module in modules:
                for stacked, own in ((params, module.get_parameter), (buffers, module.get_buffer)):
                    for name, t in stacked.items():
                        row, theirs = self._row(t, name, i), own(name)
                        (row if into_stack else theirs).copy_(theirs if into_stack else row)

    def _rates_of(self, i: int) -> dict[str, float]:
        """Member i's dropout rates where they differ between members, by module path."""
        rates = self._view.rates
        return {} if rates is None else rates.of(i)

    def _take_rates(self, i: int, module: nn.Module, where: str) -> None:
        """Takes ``module``'s dropout rates as member i's."""
        for path, sub in module.named_modules(remove_duplicate=False):
            if has_member_p(sub):
                self._set_rate(path, i, check_rate(sub.p, where, f"submodule {path!r}"))

    def __iter__(self) -> Iterator[nn.Module]:
        """The members as ordinary modules, copies (see :meth:`__getitem__`)."""
        return (self._member_module(k) for k in range(self.num_members))

    def _member_index(self, index: Any, where: str) -> int:
        n = self.num_members
        try:
            i = operator.index(index)  # ints, numpy ints, 0-d integer tensors
        except TypeError:
            raise TypeError(
                f"{where}: a member index must be an int or a slice, not "
                f"{type(index).__name__}; for several members use a slice, "
                f"phalanx.population.keep_members or stack(x, subset=[...])."
            ) from None
        if not -n <= i < n:
            raise IndexError(
                f"{where}: member index {i} is out of range for a stack of {n} members "
                f"(valid: {-n} .. {n - 1})."
            )
        return i % n

    def stacked_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The stacked parameters and buffers by name, each ``(N, *shape)``: the tensors the
        backends and ``compile_step`` run the member's forward with."""
        try:
            params = {
                name: compat.own_parameters(owner)[leaf] for name, owner, leaf in self._param_slots
            }
            buffers = {
                name: compat.own_buffers(owner)[leaf] for name, owner, leaf in self._buffer_slots
            }
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
        return params, buffers

    def _masked_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """:meth:`stacked_state` with the padded parameters behind a gradient mask: what the
        backends of a padded stack read (``phalanx.core._widths``)."""
        params, buffers = self.stacked_state()
        assert self._padding is not None
        return mask_gradients(params, self._padding), buffers

    @property
    def padding(self) -> Padding | None:
        """For a stack built with ``pad_widths=True``, each member's own shapes
        (``padding.shapes[name][i]``); None for a stack of one width."""
        return self._padding

    def zero_padding_(self) -> Self:
        """Writes 0 into every padded entry of the parameters and buffers, in place.

        Gradients are masked and the optimizers keep padded entries at 0 by themselves; call
        this after writing parameters some other way (``p.data``, a perturbation).
        """
        if self._padding is not None:
            params, buffers = self.stacked_state()
            with torch.no_grad():
                for name, t in [*params.items(), *buffers.items()]:
                    if self._padding.padded(name):
                        t.masked_fill_(~self._padding.mask(name, t), 0)
        return self

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        # The members' widths go in the state dict's metadata, for load_state_dict to check.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None and prefix[:-1] in metadata:
            metadata[prefix[:-1]][WIDTHS_KEY] = member_shapes(self._padding)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any,
                              *args: Any) -> None:  # fmt: skip
        # Before the children copy anything: a refused state dict leaves the stack as it was.
        check_loaded_widths(self._padding, state_dict, prefix, local_metadata)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    def _row(self, t: torch.Tensor, name: str, i: int) -> torch.Tensor:
        """Member i's own entries of the stacked tensor ``t`` (a view)."""
        if self._padding is None:
            return t[i]
        return t[i][self._padding.corner(name, i)]

    def apply(self, fn: Callable[[nn.Module], None]) -> Self:
        """Calls ``fn`` on every submodule of each member in turn, as on N separate modules.

        ``stack.apply(init_fn)`` initialises each member as ``init_fn`` initialises one
        module: a fan-in is the member's own, not that of the stacked ``(N, out, in)`` tensor
        (``nn.Module.apply`` on the stacked tensors would get it wrong). What ``fn`` writes
        into parameters and buffers is kept; other changes it makes are not.
        """
        params, buffers = self.stacked_state()
        with torch.no_grad():
            for i in range(self.num_members):
                member = self._member_module(i)
                member.apply(fn)
                for name, p in params.items():
                    self._row(p, name, i).copy_(member.get_parameter(name))
                for name, b in buffers.items():
                    self._row(b, name, i).copy_(member.get_buffer(name))
        return self

    def to(self, *args: Any, **kwargs: Any) -> Self:
        """``nn.Module.to``, with ``memory_format`` applied to each member's tensors.

        ``stack.to(memory_format=torch.channels_last)`` lays out every member's conv weight
        as ``member.to(memory_format=torch.channels_last)`` would: ``stack.parameters()``
        stay the same objects, holding the same values (``phalanx.core._memory_format``).
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

    # ------------------------------------------------------------- the surface for phalanx
    # What phalanx's other layers (the factory build, the population, compile_step) use of a
    # stack; nothing else of it is read from outside this module.

    @property
    def template(self) -> nn.Module:
        """Member 0's architecture on the ``meta`` device: module types, settings, modes."""
        return self._template

    @property
    def generator_slots(self) -> list[tuple[str, str]]:
        """Where the member holds ``torch.Generator`` attributes, (submodule path, name); the
        stack keeps one set per member (see docs/concepts/randomness.md)."""
        gens = self._view.generators
        return list(gens.slots) if gens is not None else []

    def member_generators(self, i: int) -> list[torch.Generator]:
        """Member i's own generators, in the order of :attr:`generator_slots` (the objects
        the loop draws from, not copies)."""
        gens = self._view.generators
        return list(gens.per_member[i]) if gens is not None else []

    @property
    def dropout_rates(self) -> dict[str, torch.Tensor]:
        """Each member's dropout rate, ``(N,)`` float64, by the path of each Dropout module
        (``nn.Dropout``, ``Dropout1d/2d/3d``) whose rate differs between members; a module
        every member gives one rate keeps it as its own ``p`` and is not listed. Copies:
        change a member's rate with ``stack[i] = module``.

        Example:
            >>> models = [nn.Sequential(nn.Linear(4, 4), nn.Dropout(p)) for p in (0.1, 0.3)]
            >>> phalanx.stack(models).dropout_rates
            {'1': tensor([0.1000, 0.3000], dtype=torch.float64)}
        """
        rates = self._view.rates
        return {} if rates is None else {k: v.clone() for k, v in rates.rates.items()}

    def _set_rates(self, path: str, values: torch.Tensor, where: str) -> None:
        """Member rates ``values`` (N,) for the Dropout module at ``path``."""
        try:
            sub = self.module.get_submodule(path)
        except AttributeError:
            sub = None
        if sub is None or not has_member_p(sub):
            raise ValueError(
                f"{where}: dropout rates were given for {path!r}, which is not a Dropout module "
                f"of the stack's members."
            )
        values = torch.as_tensor(values, dtype=torch.float64).detach().cpu().clone()
        if values.shape != (self.num_members,) or not bool(((values >= 0) & (values <= 1)).all()):
            raise ValueError(
                f"{where}: the dropout rates of {path!r} must be {self.num_members} floats in "
                f"[0, 1], one per member; got {values.tolist()}."
            )
        if self._view.rates is None:
            self._view.rates = MemberRates(self.module, {})
        self._view.rates.rates[path] = values

    def _set_rate(self, path: str, i: int, p: float) -> None:
        rates = self._view.rates
        if rates is not None and path in rates.rates:
            rates.rates[path][i] = p
        elif p != (own := _rate_of(self.module.get_submodule(path))):
            values = torch.full((self.num_members,), own, dtype=torch.float64)
            values[i] = p
            self._set_rates(path, values, "Stack[i] = module")

    @property
    def requested_backend(self) -> str:
        """The backend name the stack was given ("auto" stays "auto")."""
        return self._requested

    @contextlib.contextmanager
    def using_backend(self, name: str) -> Iterator[Self]:
        """Runs the block with backend ``name``, then restores the stack's own choice and what
        its backends had learnt (``phalanx.export`` falls back to the loop's graph so)."""
        requested, cache = self._requested, dict(self._view.cache)
        self.backend = name
        try:
            yield self
        finally:
            self._set_backend(requested)
            self._view.cache.update(cache)

    @property
    def call_lock(self) -> Any:
        """The re-entrant lock a call holds while it runs the stack's one module tree (with
        each call's tensors swapped in): two threads must not run it at once."""
        return self._view.lock

    @property
    def member_rates(self) -> Any:
        """The members' dropout rates as the backends apply them (``backends._rates``), or
        None where every member keeps its module's own rate; :attr:`dropout_rates` gives
        copies of the values."""
        return self._view.rates

    @property
    def routed_path(self) -> str | None:
        """Which path the last routed call (``members=`` or ``subset=``) took: "segment"
        (the batched row-wise path) or "general" (each member on its own rows); None before
        the first."""
        return self._view.cache_of("routed").get("last_path")

    @property
    def routed_plan(self) -> Any:
        """The plan the routed calls hold (the traced member, its row-wise proof and its
        generated forward ``.direct``), for inspection; None before the first routed call."""
        return self._view.cache_of("routed").get("plan")

    def retire(self, message: str) -> None:
        """Makes this stack refuse to train (a forward with grad raises ``message``); under
        ``torch.no_grad()`` it still evaluates its weights. ``keep_members`` retires the
        stack it replaced, whose optimizer now steps the new one."""
        object.__setattr__(self, "_retired", message)

        def refuse(module: Any, args: Any) -> None:
            if torch.is_grad_enabled():
                raise RuntimeError(f"Stack.forward(): {message}")

        self.register_forward_pre_hook(refuse)

    @property
    def retired(self) -> str | None:
        """Why this stack was retired (see :meth:`retire`), or None."""
        return getattr(self, "_retired", None)

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}, backend={self._requested!r}"

    # --------------------------------------------------------------------------------- forward

    def forward(
        self,
        *args: Any,
        in_dims: InDims = None,
        kw_in_dims: KwInDims = None,
        members: Any = None,
        weights: Any = None,
        subset: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Runs every member on its input and stacks the outputs along dim 0.

        Args:
            *args: the member's positional inputs. A shared input ``(B, ...)`` is seen by every
                member; a per-member input ``(N, B, ...)`` gives member i ``x[i]``.
            in_dims: per positional input, ``None`` (shared) or ``0`` (per-member), as in
                ``torch.func.vmap``; a single value applies to every input.
            kw_in_dims: for keyword inputs, as ``in_dims`` for positional ones: a dict of
                keyword name to ``None`` (shared) or ``0`` (per-member, ``(N, B, ...)``), or a
                single value for every keyword tensor. Keywords are shared unless declared; a
                keyword tensor whose first dimension is N but is not declared gets a warning.
            members: routes rows instead (see docs/guides/dynamics.md): an integer tensor ``(B,)``
                sends row r of every positional input to member ``members[r]``; ``(B, k)``
                to the k members ``members[r, :]``. The rows come back in the input's
                order: ``(B, ...)``, or ``(B, k, ...)`` for a ``(B, k)`` index.
            weights: with ``members``, a tensor of the index's shape: each row's output is
                ``sum_j weights[r, j] * member_{members[r, j]}(x[r])``, ``(B, ...)`` (a
                mixture-of-experts layer). Without ``members`` it is the members' own
                keyword input.
            subset: distinct member indices (a list of ints or a 1-D integer tensor): only
                those members run, at their cost alone, and the outputs are stacked in that
                order, ``(len(subset), B, ...)``; per-member inputs then have
                ``len(subset)`` as their first dimension.
            **kwargs: keyword inputs, shared by every member unless ``kw_in_dims`` says not.

        Returns:
            The members' outputs stacked on a new dim 0: ``(N, B, ...)`` for a tensor output;
            tuples and dicts of tensors keep their structure with stacked leaves. Routed
            calls return rows as described under ``members``.

        Raises:
            ValueError: a per-member input does not have N as its first dimension.

        Example:
            >>> stack = phalanx.stack([nn.Linear(4, 2) for _ in range(3)])
            >>> stack(torch.randn(5, 4)).shape
            torch.Size([3, 5, 2])
        """
        if (
            not kwargs
            and in_dims is None
            and members is None
            and subset is None
            and weights is None
            and kw_in_dims is None
        ):
            out = self._shared_call(args, kwargs)
            if out is not _GENERAL:
                return out
        if members is not None or subset is not None:
            if kw_in_dims is not None:
                raise ValueError(
                    "Stack.forward(): kw_in_dims does not apply with members= or subset=: "
                    "their keyword inputs are shared by the members that run; pass per-member "
                    "inputs positionally."
                )
            return self._routed(args, kwargs, in_dims, members, weights, subset)
        if weights is not None:
            kwargs["weights"] = weights  # the members' own keyword input
        dims = self._normalize_in_dims(in_dims, args)
        kw_dims = keyword_dims(kw_in_dims, kwargs, self.num_members, args, dims)
        self._check_devices(args, kwargs)
        check_call(self.module, kwargs)
        backend = get_backend(self._requested)
        if torch.compiler.is_compiling():
            return backend.forward(self._view, args, kwargs, dims, kw_dims)
        check_inputs(self._view, args, dims)  # a fed-back output, a shared x requiring grad
        # Every backend runs the stack's one module tree with each call's tensors swapped in
        # (torch.func.functional_call), so two threads must not run it at once.
        with self._view.lock:
            return record_outputs(
                self._view, backend.forward(self._view, args, kwargs, dims, kw_dims)
            )

    def backward_in_chunks(
        self,
        loss_fn: Callable[[Any, slice], torch.Tensor],
        *args: Any,
        chunk_members: int,
        in_dims: InDims = None,
        kw_in_dims: KwInDims = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward and backward of the members ``chunk_members`` at a time, for less memory.

        ``loss_fn(stack(*args)[rows], rows).sum().backward()`` for each chunk of members
        ``rows`` in turn: only one chunk's activations are alive at once, so the step takes
        the memory of ``chunk_members`` members' activations instead of N's. Each chunk runs
        on views of the stacked parameters and its gradients are accumulated into the stacked
        ``.grad`` (rows ``rows``), as ``backward`` accumulates; each member's gradient is the
        unchunked step's to float rounding (bit for bit where the backend's kernels do not
        depend on the number of members: the loop, and vmap on one intra-op thread, as the
        tests check).

        What the members see is what one call gives them: each member draws from its own
        ``torch.Generator`` where it holds one (the loop; ``auto`` hands such members to it),
        and a shared input the forward writes in place (``x /= 255``) is written once, by the
        first chunk, every later chunk seeing the input as given (as the loop's members do).
        Global random operations (dropout) draw chunk by chunk, not as one call draws. Every
        chunk's losses are backpropagated as ``backward`` does: an input that requires grad
        gets the gradient of the sum of every member's loss (into ``x.grad`` for a leaf;
        through its own graph, once, after the last chunk, otherwise), and so does what
        ``loss_fn`` closes over (a temperature that requires grad).

        Args:
            loss_fn: ``loss_fn(outputs, rows)`` with ``outputs`` the chunk's outputs
                ``(k, B, ...)`` and ``rows`` a ``slice`` of member indices; returns the
                chunk's per-member losses ``(k,)``, e.g. ``lambda out, rows:
                phalanx.member_losses(F.cross_entropy, out, y[rows], in_dims=(0, 0))`` for
                per-member targets ``y (N, B)``.
            *args: the inputs, as for ``stack(*args)``; per-member inputs are cut to the chunk.
            chunk_members: k >= 1, the members per chunk (the last chunk may be smaller).
            in_dims: as for ``stack(*args, in_dims=...)``.
            kw_in_dims: as for ``stack(..., kw_in_dims=...)``: the per-member keyword inputs,
                ``(N, B, ...)``, cut to the chunk; other keywords are shared.
            **kwargs: keyword inputs, shared by every member unless ``kw_in_dims`` says not.

        Returns:
            The members' losses ``(N,)``, detached.

        Raises:
            ValueError: ``chunk_members`` is not a positive int, or ``loss_fn`` does not
                return one loss per member of the chunk.

        Example:
            >>> stack = phalanx.stack([nn.Linear(4, 3) for _ in range(8)])
            >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
            >>> losses = stack.backward_in_chunks(
            ...     lambda out, rows: phalanx.member_losses(F.cross_entropy, out, y),
            ...     x, chunk_members=2)
            >>> losses.shape, stack.module.weight.grad.shape
            (torch.Size([8]), torch.Size([8, 3, 4]))
        """
        where = "Stack.backward_in_chunks()"
        k = chunk_members
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{where}: chunk_members must be a positive int; got {k!r}.")
        dims = self._normalize_in_dims(in_dims, args)
        kw_dims = keyword_dims(kw_in_dims, kwargs, self.num_members, args, dims)
        self._check_devices(args, kwargs)
        check_call(self.module, kwargs)
        if self.retired is not None:
            raise RuntimeError(f"{where}: {self.retired}")
        params, buffers = self.stacked_state()
        backend = get_backend(self._requested)
        inputs = ChunkInputs(args, dims, kwargs, kw_dims, -(-self.num_members // k))
        losses = []
        for start in range(0, self.num_members, k):
            rows = slice(start, min(start + k, self.num_members))
            leaves = {
                n: p[rows].detach().requires_grad_(p.requires_grad) for n, p in params.items()
            }
            held = (
                leaves
                if self._padding is None
                else mask_gradients(leaves, self._padding, full=params, rows=rows)
            )
            view = self._chunk_view(rows, held, {n: b[rows] for n, b in buffers.items()})
            chunk_args, chunk_kwargs = inputs.chunk(rows)
            with torch.enable_grad(), self._view.lock:
                out = backend.forward(view, chunk_args, chunk_kwargs, dims, kw_dims)
                inputs.after_first_chunk()
                loss = loss_fn(out, rows)
            size = rows.stop - rows.start
            if not isinstance(loss, torch.Tensor) or tuple(loss.shape) != (size,):
                got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ValueError(
                    f"{where}: loss_fn must return the chunk's per-member losses, shape "
                    f"({size},) for members {rows.start}..{rows.stop - 1}; got {got}. Use "
                    f"phalanx.member_losses(loss, outputs, targets[rows], in_dims=(0, 0))."
                )
            # backward as the loop's: every leaf the chunk's losses reach gets its share
            # (a temperature loss_fn closes over too); the stack's rows are this chunk's
            # detached leaves, an input's upstream graph is reached once, at the end.
            last = rows.stop == self.num_members
            loss.sum().backward(retain_graph=not last)
            with torch.no_grad():
                for name, t in leaves.items():
                    if t.grad is None:
                        continue
                    p = params[name]
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad[rows] += t.grad
            losses.append(loss.detach())
            del loss, out  # the chunk's graph goes now, before the next chunk's forward
        inputs.backward()
        return torch.cat(losses)

    def _chunk_view(
        self, rows: slice, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
    ) -> StackView:
        """A view of members ``rows`` over the given tensors: their own generators and the
        loop's per-member attributes; ``auto``'s choices are shared."""
        view = StackView(
            rows.stop - rows.start, self.module, self._template, lambda: (params, buffers)
        )
        view.lock = self._view.lock
        chosen = list(range(rows.start, rows.stop))
        if self._view.generators is not None:  # member i draws from its own generators
            view.generators = self._view.generators.subset(chosen)
        view.cache["auto"] = self._view.cache_of("auto")
        attributes = self._view.cache_of("loop").setdefault("attributes", PerMemberAttributes())
        view.cache["loop"] = {"attributes": RemappedAttributes(attributes, chosen)}
        if self._view.rates is not None:
            view.rates = self._view.rates.subset(rows)
        return view

    def _shared_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The common call, shared positional inputs and no keywords, with the general path's
        checks answered in one pass over the inputs: an input one of them could act on (on
        ``meta``, requiring grad, or N rows: ``_check_devices``, ``check_inputs``), a member
        with a config (``check_call``) or a ``torch.compile`` trace return ``_GENERAL``, and
        the general path then runs them (raising or warning exactly as before)."""
        if torch.compiler.is_compiling():  # a size compared under a trace would be a guard
            return _GENERAL
        n = self.num_members
        for a in args:
            if isinstance(a, torch.Tensor) and (
                a.is_meta or a.requires_grad or (a.dim() and a.shape[0] == n)
            ):
                return _GENERAL
        view = self._view
        if "config" in view.module.__dict__:
            return _GENERAL
        dims = _SHARED_DIMS[len(args)] if len(args) < len(_SHARED_DIMS) else (None,) * len(args)
        backend = get_backend(self._requested)
        record_ranks(view, args)  # what a member is given, for check_inputs' per-member hint
        with view.lock:
            return record_outputs(view, backend.forward(view, args, kwargs, dims, _NO_KEYWORDS))

    def _routed(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: InDims,
        members: Any,
        weights: Any,
        subset: Any,
    ) -> Any:
        """``members=`` (rows routed to members) or ``subset=`` (some members): ``_routed``."""
        self._check_devices(args, kwargs)
        if members is not None and subset is not None:
            raise ValueError(
                "Stack.forward(): members= (routing rows) and subset= (running some members "
                "on the whole input) exclude each other; give one."
            )
        if members is not None:
            if in_dims is not None:
                raise ValueError(
                    "Stack.forward(): in_dims does not apply with members=: every positional "
                    "tensor input is split by rows among the members; pass an input that every "
                    "member sees whole as a keyword argument."
                )
            with self._view.lock:
                return _routed.routed_forward(
                    self._view, self._requested, args, kwargs, members, weights
                )
        if weights is not None:
            kwargs["weights"] = weights
        chosen = _routed.subset_index(subset, self.num_members)
        dims = _normalize_in_dims(in_dims, args, len(chosen), " (the subset's size)")
        with self._view.lock:
            out = _routed.subset_segment(self._view, self._requested, args, kwargs, dims, chosen)
            if out is not None:
                return out
            view, write_back = _routed.subset_view(self._view, chosen)
            out = get_backend(self._requested).forward(view, args, kwargs, dims)
            write_back()
            return out

    def _normalize_in_dims(self, in_dims: InDims, args: tuple[Any, ...]) -> tuple[int | None, ...]:
        return _normalize_in_dims(in_dims, args, self.num_members, "")

    def _check_devices(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Refuses ``meta`` inputs to a stack holding data: no backend computes them truly."""
        meta = [
            k
            for k, a in [*enumerate(args), *kwargs.items()]
            if isinstance(a, torch.Tensor) and a.is_meta
        ]
        first = next(iter(self.stacked_state()[0].values()), None) if meta else None
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
        stack's device and dtype, in the stack's train/eval mode; in a stack built with
        ``pad_widths=True``, each at its own widths.

        Example:
            >>> stack = phalanx.stack([nn.Linear(4, 2) for _ in range(3)])
            >>> models = stack.unstack()
            >>> models[2]
            Linear(in_features=4, out_features=2, bias=True)
            >>> x = torch.randn(5, 4)
            >>> torch.allclose(models[2](x), stack(x)[2])
            True
        """
        return [self._member_module(i) for i in range(self.num_members)]

    def _member_module(self, i: int) -> nn.Module:
        params, buffers = self.stacked_state()
        own = self._template if self._padding is None else self._padding.members[i]
        member = copy.deepcopy(own)
        with torch.no_grad():
            _swap_in(
                member,
                {k: self._row(v, k, i).detach().clone() for k, v in params.items()},
                {k: self._row(v, k, i).clone() for k, v in buffers.items()},
            )
        copy_modes(self.module, member)
        if self._view.rates is not None:  # member i's own dropout rates
            for path, p in self._view.rates.of(i).items():
                member.get_submodule(path).p = p
        gens = self._view.generators
        if gens is not None:  # member i's own generators, at their current state
            memo: dict[int, Any] = {}
            for (path, key), g in zip(gens.slots, gens.per_member[i]):
                vars(member.get_submodule(path))[key] = copy.deepcopy(g, memo)
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
        pairs = list(enumerate(targets))
        # one reference, unless padded: then each member is checked at its own widths
        self._check_architecture(
            where, pairs, "the modules do not match the stack's architecture", one=True
        )
        self._copy_rows(pairs, into_stack=False)
        if self._view.rates is not None:  # each member's own dropout rates
            for i, m in enumerate(targets):
                for path, p in self._view.rates.of(i).items():
                    m.get_submodule(path).p = p


_GENERAL = object()  # Stack._shared_call: take the general path
_SHARED_DIMS = [(None,) * k for k in range(8)]  # in_dims of k shared inputs
_NO_KEYWORDS: frozenset[str] = frozenset()


def _normalize_in_dims(
    in_dims: InDims, args: tuple[Any, ...], num_members: int, what: str
) -> tuple[int | None, ...]:
    """``in_dims`` as one entry per positional input, checked against ``num_members``."""
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
        if a.dim() == 0 or a.shape[0] != num_members:
            n = num_members
            raise ValueError(
                f"{where}: with in_dims=0 the input's first dimension must be the number of "
                f"members{what}, {n}; got a tensor of shape {tuple(a.shape)}"
                + (f" (input {k})" if len(args) > 1 else "")
                + f". For one wide input sliced across members, use "
                f"phalanx.split(x, {n}, dim=1); for an input shared by all members, drop "
                f"in_dims."
            )
    return dims


def _check_backend(name: str, where: str) -> None:
    if name not in CHOICES:
        raise ValueError(
            f"{where}: unknown backend {name!r}; choose one of "
            + ", ".join(repr(c) for c in CHOICES)
            + "."
        )


def _rate_of(module: Any) -> float:
    return float(module.p)


_RATES = "dropout_rates."
"""Where a stack's state dict holds its members' dropout rates: ``dropout_rates.<path>``."""


def _save_rates(stack: Stack, state: dict[str, Any], prefix: str, _meta: Any) -> None:
    """Adds the members' dropout rates, where they differ, to the stack's state dict (so
    ``phalanx.save`` and ``torch.save(stack.state_dict())`` keep them); a stack whose members
    share every rate writes the state dict it always did."""
    for path, values in stack.dropout_rates.items():
        state[f"{prefix}{_RATES}{path}"] = values


def _load_rates(stack: Stack, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """Takes the rates back out of a state dict being loaded: a checkpoint that holds them
    sets them; one without them (members that shared every rate) gives every member the rate
    of the stack's own module."""
    keys = [k for k in state if k.startswith(prefix + _RATES)]
    rates = stack._view.rates
    if rates is not None:
        rates.rates.clear()
    for key in keys:
        stack._set_rates(key[len(prefix + _RATES) :], state.pop(key), "Stack.load_state_dict()")


def _slot(module: nn.Module, name: str) -> tuple[str, nn.Module, str]:
    owner_path, _, leaf = name.rpartition(".")
    return name, module.get_submodule(owner_path), leaf
