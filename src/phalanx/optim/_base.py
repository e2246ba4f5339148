"""``MemberOptimizer``: the rule protocol a rule declares, its settings per group, the step.

Every parameter is a stacked tensor of shape (N, *shape) whose dim 0 is the member axis.
The arithmetic is in ``_arith.py``, the settings table and its checks in ``_settings.py``,
how the step runs a rule in ``_executors.py``, the state dict in ``_state.py`` and member
surgery in ``_surgery.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from phalanx import _torch_compat as compat
from phalanx._warnings import NonFiniteWarning, warn

from . import _executors as run
from . import _state
from ._arith import finite_members, fused_step_dtype, isolate, math_dtype, per_member
from ._blocked import member_views
from ._executors import Buffers
from ._generated import generated_applies, generated_step
from ._settings import Setting, resolve_mode
from ._surgery import MemberSurgery

__all__ = ["KEEP_ELEMENTS", "MemberOptimizer", "NonFiniteWarning", "Setting"]


KEEP_ELEMENTS = 1 << 14
"""A stacked parameter of at least this many elements has its rule's ``REALIZE`` values
(per-member numbers that cost a ``pow``) computed once into a buffer when the update is
traced (:func:`phalanx._torch_compat.realized`); inductor otherwise computes them again for
every 16 of its elements. Captured steps, one process, interleaved (benchmarks/notes/
TRAIN_STEP.md): W1 (400 members, a (400, 10, 20) weight) 947 -> 752 us, W4 88.7 -> 76.9 ms,
W6 (2048 members) 150 -> 126 ms; with W2's small tensors (8 members, at most 1600 elements)
marked too the step was 5% slower (198 -> 209 us), hence the size."""


class MemberOptimizer(Buffers, MemberSurgery):
    """A torch optimizer over stacked parameters whose members are independent experiments.

    A subclass is one update rule, declared once (docs/ARCHITECTURE.md, "Add an optimizer"):

    - ``SETTINGS``: the table of its settings, ``Setting(name, kind)`` each (``"lr"`` first):
      the checks, the values its update reads, member surgery, schedulers and checkpoints
      read it;
    - ``state_names(**options)``: its state besides "step" (zeros like the parameter, unless
      ``init_state`` says otherwise);
    - ``values(h, step, started, **options)``: the per-member numbers its update reads,
      from the settings ``h`` and the (N,) step counts;
    - ``update_(p, g, state, v, scratch, **options)``: the update, in place on a block.

    The pure ``update`` that ``phalanx.compile_step`` traces is derived from ``update_``
    (the same operations on copies), so the eager and the captured step run one rule.
    Optionally ``options(group)`` (what the update branches on; by default the ``"option"``
    settings), ``fast_update`` / ``fast_takes`` (a kernel over whole stacked tensors for the
    default mode) and ``fused_update`` (torch's fused kernel, for ``mode="fused"``). This class
    validates settings, keeps per-member learning rates, applies step masks, skips members
    whose loss or gradients are not finite, and runs the rule (``_executors.py``).

    Modes: ``mode=`` says which bits member i gets; each holds whatever N, masks and
    per-member hyperparameters. ``"fast"`` (the default): the update on member i alone to
    float rounding (no further from float64 than torch.optim in float32): the rule's
    ``fast_update`` once on the whole stacked tensors where it applies (torch's fused kernel,
    where members share their values and step counts), else the arithmetic of ``"torch"``.
    ``"torch"``: torch.optim's single-tensor arithmetic on member i alone, bit for bit, on
    cache-sized blocks of the stacked tensors. ``"fused"``: torch.optim's ``fused=True`` on
    member i alone, bit for bit: torch's fused kernel on the members' views ``p[i]``, once
    per set of members that share every value (rules with ``fused_update`` only).
    ``fused=True`` is ``mode="fused"`` (the older keyword).

    Learning rates: ``group["lr"]`` is always a number, a true rate, so that torch LR schedulers
    (which multiply it or ``fill_`` it) and tools that log it (Lightning's LearningRateMonitor,
    the Trainer) work unchanged. A per-member learning rate passed as (N,) values is kept in
    ``group["member_lr"]``; ``group["lr"]`` starts at the largest member's rate and
    ``group["lr_reference"]`` keeps that start: member i's rate is
    ``group["member_lr"][i] * group["lr"] / group["lr_reference"]`` (``member_lr[i]`` itself,
    exactly, until a scheduler moves ``group["lr"]``), so ``group["lr"]`` is the rate of the
    member that started largest (1.0 if every rate is 0). A torch scheduler therefore scales
    every member's rate by one factor; ``phalanx.optim.MemberLambdaLR``, or a write to ``group["member_lr"]``,
    schedules members separately.

    Member surgery, between steps (see ``phalanx.population``): ``copy_members(source, target)``
    copies members' optimizer state and hyperparameters, ``set_hyperparameters(members, ...)``
    changes some members' hyperparameters, ``keep_members(members, params)`` drops the others.

    Attributes:
        num_members: N, the size of dim 0 of every parameter.
        last_skipped: (N,) bool, members the last ``step`` skipped because their loss or
            gradients were not finite (all False unless ``skip_nonfinite=True``).
        bad_steps: (N,) int64, how many steps of each member were skipped as non-finite.
        frozen: (N,) bool, members frozen after ``freeze_after`` non-finite steps; they are not
            updated again until you clear their flag (``opt.frozen[i] = False``).
    """

    #: The names ``values`` reads in ``h`` (derived from ``SETTINGS``): the captured step
    #: feeds each to its graph as an (N,) input.
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr",)
    #: ``values`` entries computed once under a trace for large parameters (``KEEP_ELEMENTS``).
    REALIZE: ClassVar[tuple[str, ...]] = ()
    #: Runs every parameter through ``blocked_step`` (the derived pure rule): for tests.
    _BLOCKED: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_NAME" not in cls.__dict__:
            public = cls.__module__.startswith("phalanx.optim")
            cls._NAME = f"phalanx.optim.{cls.__name__}" if public else cls.__qualname__
        if cls.SETTINGS[:1] != (Setting("lr", "rate"),):
            raise TypeError(f"{cls.__qualname__}.SETTINGS must start with Setting('lr', 'rate').")
        cls.HYPERPARAMETERS = tuple(r for s in cls.SETTINGS if s.per_member for r in s.reads)

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        skip_nonfinite: bool = False,
        freeze_after: int | None = None,
        warn_skipped: bool = True,
        mode: str | None = None,
        fused: bool = False,
    ) -> None:
        kernel = type(self).fused_update is not MemberOptimizer.fused_update
        mode = resolve_mode(self._NAME, mode, bool(fused), kernel=kernel)
        self.mode = mode
        self.fused = mode == "fused"  # the older keyword, read by the captured step
        if freeze_after is not None and not skip_nonfinite:
            raise ValueError(
                f"{self._NAME}(): freeze_after={freeze_after} needs skip_nonfinite=True; "
                "pass skip_nonfinite=True to skip and count non-finite steps."
            )
        if freeze_after is not None and (isinstance(freeze_after, bool) or freeze_after < 1):
            raise ValueError(
                f"{self._NAME}(): freeze_after must be a positive int, the number of "
                f"non-finite steps after which a member is frozen; got {freeze_after!r}."
            )
        self.num_members = -1
        self.skip_nonfinite = skip_nonfinite
        self.freeze_after = freeze_after
        self.warn_skipped = warn_skipped
        super().__init__(params, defaults)
        device = self.param_groups[0]["params"][0].device
        n = self.num_members
        self.last_skipped = torch.zeros(n, dtype=torch.bool, device=device)
        self.bad_steps = torch.zeros(n, dtype=torch.int64, device=device)
        self.frozen = torch.zeros(n, dtype=torch.bool, device=device)

    def __getstate__(self) -> dict[str, Any]:
        """torch's state (defaults, state, groups) and every public attribute: what a copy or
        pickle needs to step. Private attributes are caches (views, scratch, host counts)
        or torch's hooks, made again as needed."""
        state = super().__getstate__()
        state.update({k: v for k, v in self.__dict__.items() if not k.startswith("_")})
        return state

    # ----------------------------------------------------------------------------------------
    # The rule protocol: what a subclass declares (docs/ARCHITECTURE.md, "Add an optimizer")

    @staticmethod
    def state_names(**options: Any) -> tuple[str, ...]:
        """The names of a parameter's state besides "step" under ``options``, each shaped
        like the parameter."""
        return ()

    def init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        """A parameter's fresh state besides "step" (which this class keeps, (N,)): zeros
        like ``p`` for each of ``state_names``; a rule that starts otherwise overrides it."""
        names = self.state_names(**self.options(group))
        return {k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in names}

    @staticmethod
    def values(
        h: dict[str, Any], step: Tensor, started: frozenset[str], **options: Any
    ) -> dict[str, Any]:
        """The per-member numbers ``update_`` reads, once per parameter and step.

        Args:
            h: ``update_hyperparameters``: numbers, or (N,) tensors in the math dtype.
            step: (N,) the counts after this step's increment (float32 or float64).
            started: state entries that start this step, as zeros (SGD's momentum buffer
                after a scheduler turned momentum on), for a rule that starts them otherwise.
            **options: ``options(group)``.

        Returns:
            Numbers, or (N,) tensors that the executors cast to the parameter's dtype as
            (N, 1) and cut to a block's rows.
        """
        return dict(h)

    @staticmethod
    def update_(
        p: Tensor,
        g: Tensor,
        state: dict[str, Tensor],
        v: dict[str, Any],
        scratch: tuple[Tensor, Tensor],
        **options: Any,
    ) -> None:
        """The rule: one step of a block of members, written in place.

        Elementwise: an element of the result depends only on the same element of ``p``,
        ``g`` and the state and on its member's values, so the executors run it on blocks of
        any cut and member i's bits are the rule's on member i alone whatever N. Each torch
        operation writes its result into its target or a scratch buffer (``out=`` or an
        in-place method), so no temporary is allocated; written as torch.optim's
        single-tensor step, operation for operation, each member is torch's bit for bit.

        Args:
            p, g: the parameter and gradient (``g`` is read only): (rows, cols) views in the
                eager step, whole (N, ...) tensors in the pure ``update``.
            state: the ``state_names`` tensors, shaped as ``p``, written in place.
            v: ``values`` for these rows: numbers, or (rows, 1) tensors ((N, 1, ..., 1) in
                ``update``) in ``p``'s dtype.
            scratch: two (rows, cols) buffers the rule may overwrite.
            **options: ``options(group)``.
        """
        raise NotImplementedError("the rule defines no update_")

    @classmethod
    def update(
        cls, p: Tensor, g: Tensor, state: dict[str, Tensor], h: dict[str, Any], **options: Any
    ) -> dict[str, Tensor]:
        """The rule as a pure function (what ``phalanx.compile_step`` traces): ``update_`` on
        copies of the parameter and its state, with new scratch. Same operations, same bits.

        Args:
            p: (N, ...) the parameter; g: (N, ...) its gradient.
            state: its state, "step" (N,) already counting this step.
            h: ``update_hyperparameters(group)``: numbers or (N,) tensors.
            **options: ``options(group)``.

        Returns:
            "param" and the ``state_names`` entries (one absent from ``state`` starts as
            zeros), each shaped as ``p``.
        """
        names = cls.state_names(**options)
        started = frozenset(k for k in names if k not in state)
        # Whole (N, ...) tensors, values broadcast as (N, 1, ..., 1): elementwise, so the same
        # bits as on (rows, cols) blocks; no reshape, which inductor fused less well.
        param = p.clone(memory_format=torch.contiguous_format)
        new = {"param": param}
        for k in names:
            new[k] = (
                state[k].clone(memory_format=torch.contiguous_format)
                if k in state
                else torch.zeros_like(param)
            )
        large = p.numel() >= KEEP_ELEMENTS
        v = {
            k: per_member(compat.realized(x) if large and k in cls.REALIZE else x, param)
            for k, x in cls.values(h, state["step"], started, **options).items()
        }
        scratch = (torch.empty_like(param), torch.empty_like(param))
        cls.update_(param, g, {k: new[k] for k in names}, v, scratch, **options)
        return new

    def fused_update(
        self,
        group: dict[str, Any],
        members: list[int],
        params: list[Tensor],
        grads: list[Tensor],
        values: dict[str, Any],
    ) -> None:
        """Optional (``mode="fused"``): torch's fused kernel on the views ``p[i]`` of
        ``members``, which share the Python numbers ``values`` (``update_hyperparameters``'s
        names); "step" already counts this step. A rule without one refuses that mode."""
        raise NotImplementedError

    #: Whether the rule has a "fast" kernel over whole stacked tensors (``fast_update``).
    FAST = False

    def fast_takes(self, group: dict[str, Any]) -> bool:
        """Whether ``fast_update`` takes this group's per-member learning rates, if any
        (every other value must be one number for all members)."""
        return group["member_lr"] is None

    def fast_update(
        self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], counts: list[int]
    ) -> None:
        """Optional: the rule on whole stacked tensors with one launch (torch's fused kernel),
        for a group whose hyperparameters are numbers shared by all members and whose members
        share each parameter's step count (``counts``, before this step). Increments "step"."""
        raise NotImplementedError

    #: Elements of a block of the eager step on a CPU: a block of each stacked tensor and two
    #: scratch buffers fit in a core's L2 cache, and the Python cost per block is amortised.
    BLOCK = 1 << 18

    def block_size(self, device: torch.device) -> int | None:
        """Elements per block of the eager step on ``device``; None: whole tensors.

        On a CPU, ``BLOCK`` (measured: a block stays in a core's cache). Elsewhere (CUDA) whole
        tensors: each block costs ~10 kernel launches, and a GPU's cache is no reason to cut
        a tensor; this choice is unmeasured until a GPU runs it (docs/concepts/optimizers.md).
        """
        return self.BLOCK if device.type == "cpu" else None

    def step_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of the (N,) step counts kept in the state: float32 where torch's fused
        kernel reads them (``fused=True``, as torch.optim keeps them), else the math dtype.
        The arithmetic on them (bias corrections) is always in the math dtype."""
        kernel = self.mode == "fused" or (self.mode == "fast" and self.FAST)
        return fused_step_dtype() if kernel else math_dtype(device)

    def ensure_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        """``p``'s state, created (step 0, then ``init_state``) on first use."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros(
                self.num_members, dtype=self.step_dtype(p.device), device=p.device
            )
            state.update(self.init_state(group, p))
            counts = self.__dict__.get("_counts")
            if isinstance(counts, dict):
                counts[id(p)] = (0, id(state["step"]), compat.version(state["step"]))
        return state

    # ----------------------------------------------------------------------------------------
    # Stepping

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        mask: Tensor | Sequence[bool] | None = None,
        loss: Tensor | None = None,
    ) -> Any:
        """Takes one optimization step for the members selected by ``mask``.

        Args:
            closure: re-evaluates the model and returns the loss, as in torch.optim. If it
                returns an (N,) tensor of per-member losses, ``skip_nonfinite`` checks them.
            mask: (N,) bool. Members whose flag is False keep their weights and optimizer
                state (step count, moments) bit for bit. None updates every member.
            loss: (N,) per-member losses of this step, checked for non-finite values when
                ``skip_nonfinite`` is on; gradients are always checked then.

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: ``mask`` or ``loss`` is not of shape (N,), or ``mask`` is not bool.
        """
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        if loss is None and isinstance(result, Tensor) and result.shape == (self.num_members,):
            loss = result
        device = self.frozen.device
        active = None
        if mask is not None:
            active = torch.as_tensor(mask, device=device)
            if active.dtype != torch.bool or active.shape != (self.num_members,):
                raise ValueError(
                    f"{self._NAME}.step(): mask must be a bool tensor of shape "
                    f"({self.num_members},), one flag per member (True: update it); got "
                    f"dtype {active.dtype} and shape {tuple(active.shape)}."
                )
        if self.skip_nonfinite:
            active = self._isolate(active, loss, device)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError(f"{self._NAME}.step(): sparse gradients are not supported.")
                self.ensure_state(group, p)
            grads = [p.grad for p in params]
            counts = run.shared_counts(self, params)  # before this step; None: not shared
            self.__dict__["_step_counts"] = counts  # read by SGD's fused_update
            if self.mode == "fused" and run.fused_applies(self, params, grads):
                run.fused_step(self, group, params, grads, active)
            elif (
                active is None
                and counts is not None
                and self.mode == "fast"
                and run.fast_applies(self, group, params)
            ):
                self.fast_update(group, params, grads, counts)
            elif self._BLOCKED:
                run.blocked_step(self, group, params, grads, active)
            elif self.mode == "fast" and member_views(self, group, params):
                run.fused_step(self, group, params, grads, active)  # large members: their views
            elif (
                self.mode == "fast"
                and generated_applies(self, group, params)
                and generated_step(self, group, params, grads, active)
            ):
                pass  # large stacks: the rule's update compiled (_generated)
            else:
                run.inplace_step(self, group, params, grads, active)
            run.count(self, params, active)
        self._drop_unused_rows()
        return result

    # Step counts known on the host: while no mask has split the members, every member of a

    def _forget_counts(self) -> None:
        """The state's counts were written from outside a step (a load, member surgery)."""
        self.__dict__["_counts"] = None

    def _isolate(
        self, mask: Tensor | None, loss: Tensor | None, device: torch.device
    ) -> Tensor | None:
        """Counts non-finite members and warns; returns the members to update (None: all)."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        finite = finite_members(grads, self.num_members, device)
        if loss is not None:
            if loss.shape != (self.num_members,):
                raise ValueError(
                    f"{self._NAME}.step(): loss must hold one value per member, shape "
                    f"({self.num_members},); got shape {tuple(loss.shape)}. Pass the "
                    "per-member losses, before summing them."
                )
            finite &= torch.isfinite(loss.detach()).to(device)
        active, skipped, newly_frozen = isolate(
            finite, mask, self.frozen, self.bad_steps, self.freeze_after
        )
        self.last_skipped = skipped
        if not self.warn_skipped:
            return active  # no host sync: always the masked path
        # The one host sync of the step, which the warning needs: whether any member was
        # skipped, and whether all step (then the step takes the unmasked, fast path).
        any_skipped, all_active = torch.stack([skipped.any(), active.all()]).tolist()
        if any_skipped:
            self.warn_if_skipped(skipped, newly_frozen)
        return None if all_active else active

    def warn_if_skipped(self, skipped: Tensor, newly_frozen: Tensor | None) -> None:
        """Warns which members a step skipped (and froze): the eager and the captured step."""
        if not bool(skipped.any()):
            return
        message = (
            f"{self._NAME}.step(): skipped members {skipped.nonzero().flatten().tolist()}: "
            "their loss or gradients are not finite, so their weights and optimizer state "
            "are unchanged this step (see opt.last_skipped and opt.bad_steps)."
        )
        if newly_frozen is not None and bool(newly_frozen.any()):
            message += (
                f" Members {newly_frozen.nonzero().flatten().tolist()} are now frozen "
                f"after {self.freeze_after} non-finite steps (see opt.frozen)."
            )
        warn(message, NonFiniteWarning)

    # ----------------------------------------------------------------------------------------
    # State

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus the isolation counters under "members".

        A per-member group is saved with ``lr`` as the factor on the members' rates
        (``lr / lr_reference``, 1.0 until a scheduler moves it): the same on every rank of a
        sharded run, whose ranks hold different members (and so different largest rates)."""
        return _state.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a ``state_dict``; step counts and counters move to the parameters' device."""
        _state.load_state_dict(self, state_dict)
