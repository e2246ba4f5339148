"""The base class of phalanx optimizers: per-member hyperparameters, masks and isolation.

Every parameter is a stacked tensor of shape (N, *shape) whose dim 0 is the member axis.
A hyperparameter is a Python number shared by all members or a tensor of shape (N,), one
value per member, broadcast as (N, 1, ...) over each stacked tensor. Updates touch whole
stacked tensors with ``torch._foreach_*`` ops: the Python loops here run over parameters,
never over members.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeAlias, overload

import torch
from torch import Tensor

from phalanx import _torch_compat as compat
from phalanx._warnings import FallbackWarning, NonFiniteWarning, warn

from ._blocked import member_views
from ._generated import generated_applies, generated_step
from ._surgery import MemberSurgery, lr_factor

__all__ = ["MemberOptimizer", "NonFiniteWarning", "PerMember", "PerMemberFlag"]

# A hyperparameter as the update rules see it: a Python number shared by all members, or
# one tensor per stacked tensor, shaped (N, 1, ..., 1) in that tensor's dtype.
Hyper: TypeAlias = float | list[Tensor]

#: A hyperparameter as a user passes it: one number for all members, or one per member (an
#: (N,) tensor, a list or tuple of N numbers, a numpy array).
PerMember: TypeAlias = float | Tensor | Sequence[float]
#: A flag as a user passes it: one bool for all members, or an (N,) bool tensor.
PerMemberFlag: TypeAlias = bool | Tensor | Sequence[bool]

_EXPECTED = {"nonneg": ">= 0", "unit": "in [0, 1)", "bool": "a bool"}

#: The optimizer modes: what each member's bits are (docs/concepts/optimizers.md).
#: "fast" (the default): equal to float rounding of the float64 update, at torch's fused speed;
#: "torch": torch.optim's single-tensor arithmetic on member i alone, bit for bit;
#: "fused": torch.optim's fused=True on member i alone, bit for bit.
MODES = ("fast", "torch", "fused")


def resolve_mode(name: str, mode: str | None, fused: bool, *, kernel: bool = True) -> str:
    """The mode an optimizer runs in, from its ``mode=`` and the older ``fused=`` keyword."""
    if mode is not None and mode not in MODES:
        raise ValueError(
            f"{name}(): mode={mode!r} is not one of {MODES}: 'fast' (the default, equal to "
            "float rounding at torch's fused speed), 'torch' (torch.optim's single-tensor "
            "arithmetic per member, bit for bit) or 'fused' (torch.optim's fused=True per member)."
        )
    if fused and mode not in (None, "fused"):
        raise ValueError(
            f"{name}(): fused=True asks for mode='fused', but mode={mode!r} was passed; pass one."
        )
    chosen = "fused" if fused else (mode or "fast")
    if chosen == "fused" and not kernel:
        raise ValueError(
            f"{name}(): mode='fused' needs torch's fused kernel for this rule, and torch has "
            "none; use mode='fast' (the default) or mode='torch'."
        )
    return chosen


def math_dtype(device: torch.device) -> torch.dtype:
    """The dtype of per-member hyperparameter arithmetic (bias corrections, step sizes).

    float64, as torch.optim computes these in Python floats, so that each member matches
    torch.optim to the last bit; float32 where the device has no float64.
    """
    return torch.float32 if device.type == "mps" else torch.float64


def fused_step_dtype() -> torch.dtype:
    """The dtype of the step counts torch's fused kernels read: float32, as torch.optim keeps
    them with ``fused=True`` (``torch.optim.optimizer._get_scalar_dtype(is_fused=True)``).

    torch's CUDA kernels read each step through a ``float*`` whatever the tensor's dtype
    (``ATen/native/cuda/fused_adam_utils.cuh``): a float64 count there reads as 0 (an infinite
    step size, NaN weights). float32 counts are exact integers up to 2**24 steps.
    """
    return torch.float32


@overload
def views(h: Tensor, like: Sequence[Tensor]) -> list[Tensor]: ...
@overload
def views(h: float, like: Sequence[Tensor]) -> float: ...
@overload
def views(h: float | Tensor, like: Sequence[Tensor]) -> Hyper: ...
def views(h: float | Tensor, like: Sequence[Tensor]) -> Hyper:
    """``h`` as the update rules want it: a number, or (N,) -> per-tensor (N, 1, ..., 1) views.

    The (N,) tensor is cast to each tensor's dtype once, exactly as torch casts a Python
    number when it meets a tensor, so ``x.mul_(views(h)[i])`` rounds like ``x.mul_(float(h))``.
    A bool ``h`` stays bool, for ``torch.where``.
    """
    if not isinstance(h, Tensor):
        return h
    cache: dict[tuple[torch.device, torch.dtype, int], Tensor] = {}
    out = []
    for t in like:
        dtype = torch.bool if h.dtype == torch.bool else t.dtype
        key = (t.device, dtype, t.dim())
        if key not in cache:
            cache[key] = h.to(device=t.device, dtype=dtype).view(-1, *([1] * (t.dim() - 1)))
        out.append(cache[key])
    return out


def per_member(h: Any, like: Tensor) -> Any:
    """A number as it is; an (N,) tensor as (N, 1, ..., 1) in ``like``'s dtype and device (bool
    stays bool): how a per-member hyperparameter meets a stacked tensor (``views`` for lists)."""
    if not isinstance(h, Tensor):
        return h
    dtype = torch.bool if h.dtype == torch.bool else like.dtype
    return h.to(device=like.device, dtype=dtype).view(-1, *([1] * (like.dim() - 1)))


def maximized(g: Tensor, maximize: bool | float | Tensor) -> Tensor:
    """The gradient a rule steps against: ``-g`` where ``maximize`` (a bool, or an (N,) bool
    tensor per member), as torch's rules negate it (``g * -1`` is exactly ``-g``)."""
    if isinstance(maximize, Tensor):
        return g * per_member(torch.where(maximize, -1.0, 1.0), g)
    return -g if maximize else g


def powers(base: float | Tensor, exponent: Tensor) -> Tensor:
    """``base ** exponent`` elementwise, (N,), rounded as Python's ``float ** float`` whatever N.

    torch's vectorised ``pow`` (16 or more contiguous float64 elements) rounds some powers
    differently from the C library's ``pow`` that Python and torch's scalar loop call: with 16
    members, 578 of 18000 bias corrections ``0.9 ** t`` differed in the last bit. Strided
    operands take the scalar loop, so a member's bias correction is torch.optim's.
    """
    strided = torch.stack([exponent, exponent], -1)[..., 0]
    if isinstance(base, Tensor):
        base = torch.stack([base, base], -1)[..., 0]
    return base**strided


def rows(values: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Row j of the (P, N) tensor ``values`` as (N, 1, ..., 1) in the dtype of ``like[j]``.

    One cast per dtype for all P rows: a step costs a few launches, not a few per parameter.
    """
    cast: dict[torch.dtype, Tensor] = {}
    out = []
    for j, t in enumerate(like):
        if t.dtype not in cast:
            cast[t.dtype] = values.to(t.dtype)
        out.append(cast[t.dtype][j].view(-1, *([1] * (t.dim() - 1))))
    return out


def axpy(ys: list[Tensor], xs: list[Tensor], a: Hyper) -> list[Tensor]:
    """``ys + a * xs``, rounded as torch's ``y.add(x, alpha=a)`` (one fused multiply-add)."""
    if isinstance(a, list):
        return list(compat.foreach_addcmul(ys, xs, a))
    return list(compat.foreach_add(ys, xs, alpha=a))


def _hypers_to(group: dict[str, Any], device: torch.device) -> None:
    """Moves a group's hyperparameter tensors to its parameters' device, once."""
    for key, value in group.items():
        if isinstance(value, Tensor):
            group[key] = value.to(device)
        elif isinstance(value, tuple) and any(isinstance(v, Tensor) for v in value):
            group[key] = tuple(v.to(device) if isinstance(v, Tensor) else v for v in value)


def signed(grads: list[Tensor], maximize: float | Tensor) -> list[Tensor]:
    """The gradients, negated for the members that maximize."""
    if isinstance(maximize, Tensor):
        sign = torch.where(maximize, -1.0, 1.0)  # g * -1 is exactly -g
        return list(compat.foreach_mul(grads, views(sign, grads)))
    return list(compat.foreach_neg(grads)) if maximize else grads


def finite_members(tensors: Sequence[Tensor], n: int, device: torch.device) -> Tensor:
    """(N,) bool: True for members all of whose elements in the (N, ...) tensors are finite."""
    finite = torch.ones(n, dtype=torch.bool, device=device)
    for t in tensors:
        if t.numel():
            # one read of t: min and max are finite iff every element is (NaN propagates)
            low, high = torch.aminmax(t.reshape(n, -1), dim=1)
            finite &= (low.isfinite() & high.isfinite()).to(device)
    return finite


def isolate(
    finite: Tensor, mask: Tensor | None, frozen: Tensor, bad_steps: Tensor, freeze_after: int | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Non-finite isolation, the one rule: which members step, which are skipped, which freeze.

    ``finite`` (N,) bool: members whose loss and gradients are finite; ``mask``: the members
    asked to step (None: all). Counts each skipped member in ``bad_steps`` and, with
    ``freeze_after``, freezes a member after that many, both in place. Returns
    ``(active, skipped, newly_frozen)``, ``newly_frozen`` None without ``freeze_after``.
    """
    considered = ~frozen if mask is None else mask & ~frozen
    skipped = considered & ~finite
    bad_steps += skipped
    newly_frozen = None
    if freeze_after is not None:
        newly_frozen = ~frozen & (bad_steps >= freeze_after)
        frozen |= newly_frozen
    return considered & finite, skipped, newly_frozen


def _refer(group: dict[str, Any], largest: float) -> None:
    """Makes ``group["lr"]`` the largest member's rate (a true rate for tools that log it)."""
    reference = largest if largest > 0 else 1.0
    dict.__setitem__(group, "lr", reference)
    dict.__setitem__(group, "lr_reference", reference)


class _Group(dict[str, Any]):
    """A param group that refuses a torch LR scheduler whose values are rates, not factors.

    With per-member learning rates ``group["lr"] / group["lr_reference"]`` is a factor (1.0 at
    the start) on each member's rate, which is what StepLR, ExponentialLR, LambdaLR and the
    like compute. A
    scheduler with an absolute rate in it (CosineAnnealingLR's eta_min, OneCycleLR's max_lr,
    ...) would give member i that rate times its own: refused at its first write, which for
    most schedulers is in their constructor, before the write lands.
    """

    # what torch's schedulers write: OneCycleLR writes initial_lr and momentum first
    _WATCHED = frozenset({"lr", "initial_lr", "max_lr", "min_lr", "momentum", "betas"})

    def __setitem__(self, key: Any, value: Any) -> None:
        if key in self._WATCHED and self.get("member_lr") is not None:
            _refuse_absolute_scheduler(self)
        super().__setitem__(key, value)


def _refuse_absolute_scheduler(group: dict[str, Any]) -> None:
    """Raises if a torch LR scheduler with absolute rates is writing into a per-member group."""
    frame: Any = sys._getframe(2)
    for _ in range(8):  # the scheduler's step, get_lr or _update_lr, a few frames up
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if owner is not None and not isinstance(owner, torch.optim.lr_scheduler.LRScheduler):
            return  # the first method up the stack is not a scheduler's: ours or the user's
        if owner is not None:
            why = _absolute_rates(owner)
            if why is not None:
                name = type(owner).__name__
                if getattr(owner, "_is_initial", False):  # its constructor set this one
                    group.pop("initial_lr", None)
                raise ValueError(
                    f"{type(owner).__module__}.{name}(): this phalanx optimizer has per-member "
                    f"learning rates, so group['lr'] / group['lr_reference'] is a factor on "
                    f"each member's rate (1.0 at the start), and {why} is a rate, not a factor: "
                    f"member i would get it times its own rate over the reference. Use phalanx.optim.MemberScheduler(opt, lambda o: "
                    f"{type(owner).__module__}.{name}(o, ...)), which runs the scheduler for "
                    f"each member exactly as torch does for that member alone. Schedulers of "
                    f"factors (StepLR, ExponentialLR, LambdaLR, eta_min=0, ...) work as they are."
                )
            return
        frame = frame.f_back


def _absolute_rates(scheduler: Any) -> str | None:
    """What in ``scheduler`` is an absolute learning rate, or None for a scheduler of factors."""
    lr_scheduler = torch.optim.lr_scheduler
    if isinstance(scheduler, lr_scheduler.OneCycleLR):
        return "max_lr"
    if isinstance(scheduler, lr_scheduler.CyclicLR):
        return "base_lr / max_lr"
    if isinstance(scheduler, torch.optim.swa_utils.SWALR):
        return "swa_lr"
    cosine = (lr_scheduler.CosineAnnealingLR, lr_scheduler.CosineAnnealingWarmRestarts)
    if isinstance(scheduler, cosine) and scheduler.eta_min != 0:
        return f"eta_min={scheduler.eta_min}"
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        if any(scheduler.min_lrs):
            return f"min_lr={scheduler.min_lrs}"
        if scheduler.eps:
            return f"eps={scheduler.eps} (the smallest change of a rate it makes)"
    return None


class MemberOptimizer(MemberSurgery, torch.optim.Optimizer):
    """A torch optimizer over stacked parameters whose members are independent experiments.

    A subclass is one update rule behind one protocol, which the eager step and
    ``phalanx.compile_step`` both read: ``HYPERPARAMETERS`` (the names of the per-member
    hyperparameters its update takes), ``update_hyperparameters(group)`` (their values),
    ``options(group)`` (the Python values it branches on), ``init_state`` and the pure,
    elementwise ``update``; optionally ``fused_update``, torch's fused kernel for
    ``fused=True``. It lists its group's keys with their kinds in ``_HYPER`` for validation.
    This class validates hyperparameters, keeps per-member learning rates, applies step masks,
    skips members whose loss or gradients are not finite, and runs the rule on cache-sized
    blocks of the stacked tensors (see docs/ARCHITECTURE.md, "Adding an optimizer").

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

    # (name, kind) of each hyperparameter besides lr; kind is a key of _EXPECTED.
    _HYPER: tuple[tuple[str, str], ...] = ()
    _NAME = "phalanx.optim.MemberOptimizer"

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        skip_nonfinite: bool = False,
        freeze_after: int | None = None,
        warn_skipped: bool = True,
        mode: str = "fast",
    ) -> None:
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

    # What torch's Optimizer.__getstate__ leaves out (it keeps defaults, state and groups):
    # without them a deepcopy or pickle of the optimizer could not step.
    _MEMBER_ATTRS = (
        "num_members",
        "skip_nonfinite",
        "freeze_after",
        "warn_skipped",
        "mode",
        "fused",
        "last_skipped",
        "bad_steps",
        "frozen",
    )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in self._MEMBER_ATTRS if k in self.__dict__})
        return state

    # ----------------------------------------------------------------------------------------
    # Parameter groups and hyperparameters

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a parameter group after checking its member axis and hyperparameters."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for j, p in enumerate(params):
            if not isinstance(p, Tensor):
                continue  # torch's own check gives the message
            if p.dim() == 0 or (self.num_members >= 0 and p.shape[0] != self.num_members):
                raise ValueError(
                    f"{self._NAME}(): parameter {j} of group {len(self.param_groups)} has shape "
                    f"{tuple(p.shape)}, expected (N, *shape) with N = "
                    f"{self.num_members if self.num_members >= 0 else 'the number of members'}"
                    ". Every parameter must be stacked with the member axis first, as "
                    "phalanx.stack(models).parameters() are."
                )
            self.num_members = p.shape[0]
        param_group["params"] = params
        for key in ("lr", *(name for name, _ in self._HYPER)):
            if key in param_group:
                param_group[key] = self._as_hyper(param_group[key], key)
            elif key in self.defaults:
                self.defaults[key] = self._as_hyper(self.defaults[key], key)
        lr = param_group.get("lr", self.defaults.get("lr"))
        if isinstance(lr, Tensor) and lr.dim() > 0:
            param_group["member_lr"] = lr
            param_group["lr"] = 1.0
        super().add_param_group(_Group(param_group))
        group = self.param_groups[-1]
        group.setdefault("member_lr", None)
        if group["member_lr"] is not None:
            group["member_lr"] = self._check_hyper(group["member_lr"], "lr", "nonneg")
            _refer(group, float(torch.as_tensor(group["member_lr"]).max()))
        group.setdefault("lr_reference", None)
        group["lr"] = self._check_hyper(group["lr"], "lr", "nonneg")
        for name, kind in self._HYPER:
            value = group[name]
            if isinstance(value, tuple | list):  # betas
                group[name] = tuple(
                    self._check_hyper(v, f"{name}[{k}]", kind) for k, v in enumerate(value)
                )
            else:
                group[name] = self._check_hyper(value, name, kind)
        if params:
            _hypers_to(group, params[0].device)
        self._check_group(group)

    def _as_hyper(self, value: Any, name: str) -> Any:
        """A hyperparameter given as a list, tuple or numpy array of per-member values as an
        (N,) tensor (float64, or bool for flags); betas' pair keeps its tuple."""
        if name == "betas" and isinstance(value, tuple | list) and len(value) == 2:
            return tuple(self._as_hyper(v, f"{name}[{k}]") for k, v in enumerate(value))
        if isinstance(value, Tensor | bool | int | float) or value is None:
            return value
        if isinstance(value, list | tuple) or type(value).__module__ == "numpy":
            try:
                tensor = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError) as e:
                raise TypeError(
                    f"{self._NAME}(): {name} must be a number or one value per member (a "
                    f"tensor, list or numpy array of shape (N,)); got {value!r} ({e})."
                ) from None
            if tensor.dtype == torch.bool:
                return tensor
            if isinstance(value, list | tuple):  # Python floats keep their double values
                tensor = torch.tensor(value, dtype=torch.float64)
            if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64)):
                raise TypeError(
                    f"{self._NAME}(): {name} must hold numbers; got a {tensor.dtype} array."
                )
            return tensor.to(torch.float64) if tensor.dim() else float(tensor)
        return value

    def _check_hyper(self, value: Any, name: str, kind: str) -> Any:
        """Checks one hyperparameter: a number (or bool), or a tensor of shape (N,)."""
        n = self.num_members
        if isinstance(value, Tensor):
            value = value.detach()
            if value.shape not in {(), (n,)}:
                raise ValueError(
                    f"{self._NAME}(): {name} has shape {tuple(value.shape)}; expected a number "
                    f"or a tensor of shape ({n},), one value per member."
                )
            values = value.reshape(-1)
            if kind == "bool":
                if value.dtype != torch.bool:
                    raise ValueError(
                        f"{self._NAME}(): {name} has dtype {value.dtype}; expected a bool or "
                        f"a bool tensor of shape ({n},)."
                    )
                return value
            if not value.is_floating_point():
                value = values = value.double()
        elif kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"{self._NAME}(): {name} must be a bool; got {value!r}.")
            return value
        else:
            values = torch.tensor([float(value)], dtype=torch.float64)
        bad = ~((values >= 0) & ((values < 1) if kind == "unit" else values.isfinite()))
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            who = f"member {k}" if values.numel() > 1 else "every member"
            raise ValueError(
                f"{self._NAME}(): {name} is {values[k].item()} for {who}; expected "
                f"{_EXPECTED[kind]}."
            )
        return value

    def _values(self, value: Any, device: torch.device) -> float | Tensor:
        """A group's hyperparameter as a number or an (N,) tensor in the math dtype."""
        if isinstance(value, bool):
            return value
        if not isinstance(value, Tensor):
            return float(value)
        if value.shape not in {(), (self.num_members,)}:
            raise ValueError(
                f"{self._NAME}.step(): a param group holds a hyperparameter of shape "
                f"{tuple(value.shape)}; expected a number or shape ({self.num_members},)."
            )
        dtype = torch.bool if value.dtype == torch.bool else math_dtype(device)
        return value.to(device=device, dtype=dtype).expand(self.num_members)

    def _lr(self, group: dict[str, Any], device: torch.device) -> float | Tensor:
        """The learning rate of a group: one number, or (N,) in the math dtype."""
        lr = self._values(group["lr"], device)
        if group["member_lr"] is None:
            return lr
        return self._values(group["member_lr"], device) * lr_factor(group)

    # ----------------------------------------------------------------------------------------
    # The update-rule protocol: what a subclass defines, and what the eager step and
    # phalanx.compile_step both read (docs/ARCHITECTURE.md, "Adding an optimizer").

    #: The names of the hyperparameters ``update`` takes in ``h``, as
    #: returns them (the captured step feeds each to its graph as an (N,) input).
    HYPERPARAMETERS: tuple[str, ...] = ()

    def update_hyperparameters(self, group: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """A group's hyperparameters as ``update`` takes them, by ``HYPERPARAMETERS`` name:
        each a Python number shared by all members or an (N,) tensor in the math dtype (bool
        for flags). "lr" is the member's rate (``group["lr"]`` times ``member_lr``); any other
        name is the group's entry of that name. A rule whose names differ from its group's
        keys (Adam's "beta1" from ``betas``) overrides this."""
        return {
            name: self._lr(group, device) if name == "lr" else self._values(group[name], device)
            for name in self.HYPERPARAMETERS
        }

    def options(self, group: dict[str, Any]) -> dict[str, Any]:
        """The Python values ``update`` branches on for this group (Adam's ``amsgrad``): the
        captured graph is specialised on them, so they must be few and rarely change."""
        return {}

    def init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        """A parameter's fresh optimizer state besides "step" (which this class keeps, (N,)),
        each tensor shaped like ``p`` (N, *shape) or (N,)."""
        raise NotImplementedError(f"{type(self).__name__} defines no init_state")

    @staticmethod
    def update(
        p: Tensor, g: Tensor, state: dict[str, Tensor], h: dict[str, Any], **options: Any
    ) -> dict[str, Tensor]:
        """The rule: one step of a stacked parameter, nothing written (a pure function).

        Args:
            p: (N, ...) the parameter; g: (N, ...) its gradient.
            state: its state, "step" (N,) already counting this step.
            h: ``update_hyperparameters(group)``: numbers or (N,) tensors, broadcast over a stacked
                tensor with ``per_member``.
            **options: ``options(group)``.

        Returns:
            "param" and the state entries that change (a key absent from ``state`` is added
            to it), each shaped as its input. Elementwise: an element of the result depends
            only on the same element of ``p``, ``g`` and the state and on its member's
            hyperparameters, so the eager step runs it on cache-sized blocks of the stacked
            tensors and member i's bits are torch.optim's on member i alone whatever N.
        """
        raise NotImplementedError

    def fused_update(
        self,
        group: dict[str, Any],
        members: list[int],
        params: list[Tensor],
        grads: list[Tensor],
        values: dict[str, Any],
    ) -> None:
        """Optional (``fused=True``): torch's fused kernel on the views ``p[i]`` of
        ``members``, which share the Python numbers ``values`` (``update_hyperparameters``'s names);
        "step" already counts this step. Rules without a torch kernel leave it undefined."""
        raise NotImplementedError

    # Optional, for speed: the same rule in place. The eager step prefers it where defined.

    #: The rule's arithmetic in place: defined by a rule that writes an ``update_``.
    INPLACE = False

    def prepare(
        self, h: dict[str, Any], step: Tensor, dtype: torch.dtype, **options: Any
    ) -> dict[str, Any]:
        """Per-member values ``update_`` reads, computed once per parameter and step from
        ``update_hyperparameters``'s ``h`` (numbers or (N,) tensors) and ``step`` (N,), the
        count after this step's increment: numbers, or (N,) tensors that the eager step cuts
        to a block's members and casts to ``dtype`` as (rows, 1). By default ``h`` itself."""
        return dict(h)

    def inplace_applies(self, state: dict[str, Any], options: dict[str, Any]) -> bool:
        """Whether ``update_`` can step this parameter now (SGD: its momentum buffer exists);
        otherwise the step runs ``update`` on blocks."""
        return True

    @staticmethod
    def update_(
        p: Tensor,
        g: Tensor,
        state: dict[str, Tensor],
        v: dict[str, Any],
        scratch: tuple[Tensor, Tensor],
        **options: Any,
    ) -> None:
        """``update`` in place on a block: the same torch operations on the same operands, in
        the same order, each writing its result into its target or a scratch buffer (``out=``),
        so the bits are ``update``'s and no temporary is allocated.

        Args:
            p, g: (rows, cols) views of the parameter and gradient (``g`` is read only).
            state: (rows, cols) views of the state tensors shaped like ``p``, written in place.
            v: ``prepare``'s values for these rows: numbers, or (rows, 1) tensors in ``p``'s
                dtype.
            scratch: two (rows, cols) buffers the rule may overwrite.
            **options: ``options(group)``.
        """
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

    def member_hyperparameters(
        self, group: dict[str, Any], device: torch.device
    ) -> dict[str, Tensor]:
        """``update_hyperparameters`` with every value an (N,) tensor (bool for flags): the captured
        step's graph inputs, so that a new value changes an input, not the graph."""
        n = self.num_members
        out = {}
        for name, value in self.update_hyperparameters(group, device).items():
            if isinstance(value, Tensor):
                out[name] = value.contiguous()
            elif isinstance(value, bool):
                out[name] = torch.full((n,), value, device=device)
            else:
                out[name] = torch.full((n,), value, dtype=math_dtype(device), device=device)
        return out

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
            counts = self._shared_counts(params)  # before this step; None: not shared
            self.__dict__["_step_counts"] = counts  # read by SGD's fused_update
            if self.mode == "fused" and self._fused_applies(params, grads):
                self._fused_step(group, params, grads, active)
            elif (
                active is None
                and counts is not None
                and self.mode == "fast"
                and self._fast_applies(group, params)
            ):
                self.fast_update(group, params, grads, counts)
            elif self.mode == "fast" and member_views(self, group, params):
                self._fused_step(group, params, grads, active)  # large members: their views
            elif (
                self.mode == "fast"
                and generated_applies(self, group, params)
                and generated_step(self, group, params, grads, active)
            ):
                pass  # large stacks: the rule's update compiled (_generated)
            elif self.INPLACE:
                self._inplace_step(group, params, grads, active)
            else:
                self._blocked_step(group, params, grads, active)
            self._count(params, active)
        self._drop_unused_rows()
        return result

    # Step counts known on the host: while no mask has split the members, every member of a
    # parameter has the same count, and the host counts steps as it takes them, so the fast
    # path knows it may run one kernel with one count, with no read of a device value.
    # ``_counts``: id(param) -> (its count, id and ``_version`` of its "step" tensor when
    # counted), so a write from elsewhere (the captured step, surgery, a load, the user) makes
    # it unknown; False once a mask may have split the members; None (or absent: a copy, a
    # pickle) when unknown: read once from the state (one host sync).

    def _shared_counts(self, params: list[Tensor]) -> list[int] | None:
        """The step count of each parameter before this step, where its members share it."""
        counts = self.__dict__.get("_counts")
        if counts is False:
            return None
        if counts is None or not all(self._counted(counts, p) for p in params):
            counts = self.__dict__["_counts"] = self._read_counts()
            if counts is False:
                return None
        return [counts[id(p)][0] for p in params]

    def _counted(self, counts: dict[int, tuple[int, int, int]], p: Tensor) -> bool:
        """Whether the host's count of ``p`` is its state's (nothing wrote it since)."""
        entry, step = counts.get(id(p)), self.state[p].get("step")
        return entry is not None and entry[1:] == (
            id(step),
            compat.version(step) if step is not None else -1,
        )

    def _read_counts(self) -> dict[int, tuple[int, int, int]] | Literal[False]:
        """The counts read from the state (one host sync, once after a load or surgery)."""
        steps = {
            id(p): s["step"]
            for g in self.param_groups
            for p in g["params"]
            if isinstance((s := self.state.get(p, {})).get("step"), Tensor)
        }
        if not steps:
            return {}
        low_high = torch.stack(
            [torch.stack([s.min(), s.max()]).to(torch.float64) for s in steps.values()]
        ).tolist()
        if any(low != high for low, high in low_high):
            return False
        return {
            k: (int(low), id(s), compat.version(s))
            for (k, s), (low, _) in zip(steps.items(), low_high, strict=True)
        }

    def _count(self, params: list[Tensor], active: Tensor | None) -> None:
        """Counts a step of ``params`` on the host (forgets the counts after a masked step)."""
        counts = self.__dict__.get("_counts")
        if active is not None:
            self.__dict__["_counts"] = False
        elif isinstance(counts, dict):
            for p in params:
                step = self.state[p]["step"]
                if id(p) in counts:
                    counts[id(p)] = (counts[id(p)][0] + 1, id(step), compat.version(step))

    def member_rates(
        self, group: dict[str, Any], device: torch.device
    ) -> dict[torch.dtype, Tensor]:
        """A per-member group's (N,) rates, cast once to each of its parameters' dtypes."""
        rates = self._lr(group, device)
        assert isinstance(rates, Tensor)
        return {p.dtype: rates.to(p.dtype) for p in group["params"]}

    def _forget_counts(self) -> None:
        """The state's counts were written from outside a step (a load, member surgery)."""
        self.__dict__["_counts"] = None

    def _fast_applies(self, group: dict[str, Any], params: list[Tensor]) -> bool:
        """Whether ``fast_update`` can take this group now: the rule has it, every
        hyperparameter is one number for all members, and every tensor is contiguous on a
        device torch's fused kernels support, in one floating dtype per parameter."""
        if not self.FAST or not self.fast_takes(group):
            return False
        for key, value in group.items():
            if key == "member_lr":
                continue
            if isinstance(value, Tensor) or (
                isinstance(value, tuple) and any(isinstance(v, Tensor) for v in value)
            ):
                return False
        for p in params:
            if p.device.type not in ("cpu", "cuda") or not p.is_floating_point():
                return False
            state = [v for k, v in self.state[p].items() if k != "step"]
            for t in [p.grad, *state]:
                if t is None or t.shape != p.shape or t.dtype != p.dtype:
                    return False
            if not all(t.is_contiguous() for t in [p, p.grad, *state]):
                return False
        return True

    def _kept_rows(self, t: Tensor) -> list[Tensor]:
        """The N members' views ``t[i]`` of a stacked tensor that persists across steps (a
        parameter, its optimizer state), for torch's fused kernels, which take one tensor per
        member; kept across steps instead of made anew (for a transformer of 15 stacked
        tensors and 8 members, 600 ``select`` calls a step).

        A view is made again whenever its tensor is another object or holds other memory
        (``.data`` assigned, ``.to()``, a state loaded, a resize), so it always views what the
        step must write; kept views of tensors no longer stepped are dropped at the end of the
        step. Never for gradients: they are new every step. Not in ``state_dict``, nor in a
        copy or pickle of the optimizer.
        """
        cache: dict[int, tuple[Tensor, tuple, list[Tensor]]]
        cache = self.__dict__.setdefault("_rows", {})
        self.__dict__.setdefault("_rows_used", set()).add(id(t))
        key = (compat.memory_stamp(t), torch.is_inference_mode_enabled())
        entry = cache.get(id(t))
        if entry is None or entry[0] is not t or entry[1] != key:
            entry = cache[id(t)] = (t, key, [t[i] for i in range(t.shape[0])])
        return entry[2]

    def _drop_unused_rows(self) -> None:
        """Forgets the kept views of tensors this step did not use (a replaced state's)."""
        used = self.__dict__.get("_rows_used")
        if used is None:
            return
        cache = self.__dict__["_rows"]
        if len(cache) != len(used):
            self.__dict__["_rows"] = {k: v for k, v in cache.items() if k in used}
        used.clear()

    def _scratch(self, p: Tensor, count: int, size: int) -> list[Tensor]:
        """``count`` buffers of ``size`` elements or more in ``p``'s dtype and device, kept
        across steps (never part of the state: a state_dict does not hold them)."""
        cache: dict[tuple[torch.device, torch.dtype], list[Tensor]]
        cache = self.__dict__.setdefault("_scratch_buffers", {})
        key = (p.device, p.dtype)
        kept = cache.setdefault(key, [])
        if kept and kept[0].numel() < size:
            kept.clear()  # a larger block: all anew
        while len(kept) < count:
            kept.append(
                torch.empty(
                    max(size, kept[0].numel() if kept else 0), dtype=p.dtype, device=p.device
                )
            )
        return kept[:count]

    def _inplace_step(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        active: Tensor | None,
    ) -> None:
        """``update_`` on blocks of each stacked tensor (``block_size``), in place: the rule's
        torch operations write into the parameter, its state and two scratch buffers reused
        across steps, so a step reads and writes each block while it is in cache and allocates
        nothing the size of a block. With a mask (a tensor: never read on the host), each
        block's parameter and state rows are kept in scratch first and put back for the
        masked members (``torch.where``), so their values and counts stay bit for bit. A
        parameter the rule cannot step in place now (a strided one, SGD before its buffer
        exists) takes ``_blocked_step``."""
        device = params[0].device
        h = self.update_hyperparameters(group, device)
        options = self.options(group)
        rule = type(self).update_
        block = self.block_size(device)
        rest: tuple[list[Tensor], list[Tensor]] = ([], [])
        for p, g in zip(params, grads, strict=True):
            state = self.state[p]
            flat = _flat_views(p, g, state)
            if flat is None or not self.inplace_applies(state, options):
                rest[0].append(p)
                rest[1].append(g)
                continue
            step = state["step"].to(math_dtype(p.device)) + 1  # no copy unless float32 counts
            values = self.prepare(h, step, p.dtype, **options)
            # (N, 1) in p's dtype, cast once for the parameter (as the pure rule's per_member)
            whole = {
                k: per_member(x, flat["param"]) if isinstance(x, Tensor) else x
                for k, x in values.items()
            }
            n, m = flat["param"].shape
            size = max(1, n * m) if block is None else block
            kept = [k for k in flat if k != "grad"]  # what a masked member keeps
            a, b, *saved = self._scratch(p, 2 + (len(kept) if active is not None else 0), size)
            keep = None if active is None else active.to(p.device).view(-1, 1)
            cut: tuple[int, int] | None = None
            v: dict[str, Any] = {}
            for r0, r1, c0, c1 in _inplace_blocks(n, m, size):
                if cut != (r0, r1):  # one block's members' values, reused by the next block
                    cut = (r0, r1)
                    v = {k: x[r0:r1] if isinstance(x, Tensor) else x for k, x in whole.items()}
                shape = (r1 - r0, c1 - c0)
                numel = shape[0] * shape[1]
                views = {k: t[r0:r1, c0:c1] for k, t in flat.items()}
                backup = [buf[:numel].view(shape) for buf in saved]
                for k, buf in zip(kept, backup, strict=False):
                    buf.copy_(views[k])
                scratch = (a[:numel].view(shape), b[:numel].view(shape))
                pv, gv = views.pop("param"), views.pop("grad")
                rule(pv, gv, views, v, scratch, **options)
                if keep is not None:
                    views["param"] = pv
                    for k, buf in zip(kept, backup, strict=True):
                        torch.where(keep[r0:r1], views[k], buf, out=views[k])
            if active is None:
                state["step"].copy_(step)
            else:
                state["step"].add_(active.to(p.device))  # + 1 for the members that stepped
        if rest[0]:
            self._blocked_step(group, rest[0], rest[1], active)

    def _blocked_step(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        active: Tensor | None,
    ) -> None:
        """``update`` on blocks of ``BLOCK`` elements of each stacked tensor, written back in
        place: no temporary larger than a block, and a masked member's block keeps its old
        values (``torch.where`` into the state), so nothing the size of the stack is cloned."""
        device = params[0].device
        h = self.update_hyperparameters(group, device)
        options = self.options(group)
        rule = type(self).update
        for p, g in zip(params, grads, strict=True):
            state = self.state[p]
            step = state["step"].to(math_dtype(p.device)) + 1  # no copy unless fused's float32
            keep = None if active is None else active.to(p.device)
            started: dict[str, Tensor] = {}  # state entries the rule starts now (SGD's buffer)
            block = self.block_size(p.device)
            for rows, flat, blocks in _blocks(p, g, state, block or max(1, p.numel())):
                part = {k: v[blocks] for k, v in flat.items() if k not in ("param", "grad")}
                part["step"] = step[rows]
                hb = {k: v[rows] if isinstance(v, Tensor) else v for k, v in h.items()}
                new = rule(flat["param"][blocks], flat["grad"][blocks], part, hb, **options)
                for key, value in new.items():
                    if key not in flat and key not in started:
                        state[key] = torch.zeros_like(p)
                        whole = flat["param"] is p
                        started[key] = state[key] if whole else state[key].view(p.shape[0], -1)
                    target = (flat[key] if key in flat else started[key])[blocks]
                    if keep is None:
                        target.copy_(value)
                    else:
                        m = keep[rows].view(-1, *([1] * (target.dim() - 1)))
                        torch.where(m, value, target, out=target)
            if keep is None:
                state["step"].copy_(step)
            else:
                state["step"].add_(keep)  # + 1 for the members that stepped

    def _fused_applies(self, params: list[Tensor], grads: list[Tensor]) -> bool:
        """Whether torch's fused kernel can run on the members' views: each must be
        contiguous (a member's view of a contiguous stacked tensor is). Otherwise the step
        runs the exact single-tensor path, and says so once."""
        tensors = [*params, *grads]
        tensors += [t for p in params for t in self.state[p].values() if t.dim() > 1]
        if all(t.is_contiguous() for t in tensors):
            return True
        if not getattr(self, "_warned_fused", False):
            self._warned_fused = True
            warn(
                f"{self._NAME}(fused=True): a parameter, gradient or state tensor is not "
                "contiguous, so torch's fused kernel cannot run on the members' views; this "
                "step runs the default (single-tensor) arithmetic, whose bits are those of "
                "torch.optim without fused=True.",
                FallbackWarning,
            )
        return False

    def _fused_step(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        active: Tensor | None,
    ) -> None:
        """torch's fused kernel once per set of members that share every hyperparameter
        value, on the members' views ``p[i]``: each view is its own tensor to the kernel (its
        own vector body and tail), so member i gets the bits of ``torch.optim`` with
        ``fused=True`` on member i alone, whatever N, and a masked member is left out."""
        device = params[0].device
        n = self.num_members
        columns = self._member_columns(group, device)
        flags = [True] * n if active is None else active.tolist()  # fused=True's mask: 1 sync
        steps = [self.state[p]["step"] for p in params]
        if active is None:
            compat.foreach_add_(steps, 1)
        else:
            increment = active.to(device=steps[0].device, dtype=steps[0].dtype)
            compat.foreach_add_(steps, [increment] * len(steps))
        sets: dict[tuple, list[int]] = {}
        for i in range(n):
            if flags[i]:
                sets.setdefault(tuple(column[i] for column in columns.values()), []).append(i)
        for key, members in sets.items():
            self.fused_update(group, members, params, grads, dict(zip(columns, key)))

    def _member_columns(self, group: dict[str, Any], device: torch.device) -> dict[str, list]:
        """Each member's hyperparameter values as Python numbers (``update_hyperparameters``'
        names), read from the device once and kept until an entry of the group changes (a
        scheduler's write, a tensor written in place): a steady step reads nothing."""
        stamp = tuple(
            (k, id(v), compat.version(v) if isinstance(v, Tensor) else v)
            for k, v in group.items()
            if k != "params"
        )
        kept = self.__dict__.setdefault("_columns", {})
        entry = kept.get(id(group))
        if entry is None or entry[0] != stamp:
            n = self.num_members
            h = self.update_hyperparameters(group, device)
            columns = {k: v.tolist() if isinstance(v, Tensor) else [v] * n for k, v in h.items()}
            entry = kept[id(group)] = (stamp, columns)
        return entry[1]

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
        out = super().state_dict()
        for group in out["param_groups"]:
            reference = group.pop("lr_reference", None)
            if group.get("member_lr") is not None and reference is not None:
                group["lr"] = float(group["lr"]) / reference
                if "initial_lr" in group:
                    group["initial_lr"] = float(group["initial_lr"]) / reference
        out["members"] = {
            "last_skipped": self.last_skipped.clone(),
            "bad_steps": self.bad_steps.clone(),
            "frozen": self.frozen.clone(),
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a ``state_dict``; step counts and counters move to the parameters' device."""
        state_dict = dict(state_dict)
        members = state_dict.pop("members", None)
        _check_state_names(self, state_dict)
        super().load_state_dict(state_dict)
        self.param_groups = [_Group(group) for group in self.param_groups]
        for group in self.param_groups:  # the saved factor back on the largest member's rate
            if group.get("member_lr") is not None and "lr_reference" not in group:
                factor, initial = float(group["lr"]), group.get("initial_lr")
                _refer(group, float(torch.as_tensor(group["member_lr"]).max()))
                reference = group["lr_reference"]
                dict.__setitem__(group, "lr", factor * reference)
                if initial is not None:
                    dict.__setitem__(group, "initial_lr", float(initial) * reference)
            group.setdefault("lr_reference", None)
        for group in self.param_groups:
            _hypers_to(group, group["params"][0].device)
        for p, state in self.state.items():
            if isinstance(state.get("step"), Tensor):
                state["step"] = state["step"].to(p.device, self.step_dtype(p.device))
        self._forget_counts()
        if members is not None:
            device = self.frozen.device
            self.last_skipped = members["last_skipped"].to(device, torch.bool)
            self.bad_steps = members["bad_steps"].to(device, torch.int64)
            self.frozen = members["frozen"].to(device, torch.bool)


def _check_state_names(opt: MemberOptimizer, state_dict: dict[str, Any]) -> None:
    """Refuses, before anything is loaded, a state dict whose per-parameter state is not the
    rule's (Adam's ``exp_avg`` in SGD): torch.optim loads it silently and then steps with
    state it never reads, or fails at the first step. The names expected are the rule's
    ``init_state`` under the saved group's hyperparameters, plus "step"."""
    groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        return  # torch's own load says what is wrong
    if len(groups) != len(opt.param_groups):
        return
    where = f"phalanx.optim.{type(opt).__name__}.load_state_dict()"
    found = []
    for mine, saved in zip(opt.param_groups, groups):
        if not isinstance(saved, dict) or len(saved.get("params", ())) != len(mine["params"]):
            return
        merged = {**mine, **{k: v for k, v in saved.items() if k != "params"}}
        for p, key in zip(mine["params"], saved["params"]):
            entry = state.get(key)
            if not isinstance(entry, dict) or not entry:
                continue
            try:
                want = {"step", *opt.init_state(merged, torch.empty_like(p, device="meta"))}
            except (KeyError, TypeError) as e:
                found.append(f"its param group lacks {e} that {type(opt).__name__} needs")
                break
            have = set(entry)
            if have != want and have - {"step"} != want - {"step"}:
                found.append(
                    f"parameter {key}: state {sorted(have)}, where {type(opt).__name__} keeps "
                    f"{sorted(want)}"
                )
    if found:
        raise ValueError(
            f"{where}: the state dict is not one of this optimizer's (saved by another "
            f"optimizer type?):\n  - "
            + "\n  - ".join(found[:5])
            + "\nLoad it into the optimizer type that saved it, or start this one fresh."
        )


def _flat_view(t: Tensor, p: Tensor) -> Tensor | None:
    """``t`` as (N, M) without a copy, when it is shaped like ``p``; else None."""
    if t.shape != p.shape or p.dim() < 1:
        return None
    try:
        return t.view(p.shape[0], -1)
    except RuntimeError:  # not viewable (strided): the rule runs on the whole tensor
        return None


def _blocks(
    p: Tensor, g: Tensor, state: dict[str, Any], size: int
) -> Iterator[tuple[slice, dict[str, Tensor], tuple[slice, ...]]]:
    """The blocks of ``update``: (member rows, the tensors by name as (N, M) views, the
    block's index into them), ``size`` elements or so each, rows of members first."""
    tensors = {"param": p, "grad": g, **{k: v for k, v in state.items() if k != "step"}}
    flat = {k: _flat_view(v, p) for k, v in tensors.items()}
    n = p.shape[0] if p.dim() else 1
    if any(v is None for v in flat.values()) or p.numel() <= size:
        yield slice(0, n), tensors, (slice(None),)  # one block: the tensors as they are
        return
    views: dict[str, Tensor] = flat  # type: ignore[assignment]
    m = p.numel() // n
    if m >= size:
        for i in range(n):
            for c in range(0, m, size):
                yield slice(i, i + 1), views, (slice(i, i + 1), slice(c, c + size))
    else:
        per = max(1, size // m)
        for r in range(0, n, per):
            yield slice(r, r + per), views, (slice(r, r + per), slice(None))


def _flat_views(p: Tensor, g: Tensor, state: dict[str, Any]) -> dict[str, Tensor] | None:
    """``p``, ``g`` and ``p``'s state tensors as (N, M) views (no copy), or None when one of
    them cannot be viewed so (a strided tensor) or ``p`` has no member axis."""
    tensors = {"param": p, "grad": g, **{k: v for k, v in state.items() if k != "step"}}
    flat = {k: _flat_view(v, p) for k, v in tensors.items()}
    if any(v is None or not v.is_contiguous() for v in flat.values()):
        return None
    return flat  # type: ignore[return-value]


def _inplace_blocks(n: int, m: int, size: int) -> Iterator[tuple[int, int, int, int]]:
    """(row start, row stop, column start, column stop) of the blocks of an (n, m) tensor,
    ``size`` elements or fewer each: a row longer than ``size`` in column chunks, shorter rows
    several to a block (all of them when ``size`` is the tensor's)."""
    if m >= size and n > 1:
        for i in range(n):
            for c in range(0, m, size):
                yield i, i + 1, c, min(c + size, m)
    elif m >= size:
        for c in range(0, m, size):
            yield 0, 1, c, min(c + size, m)
    else:
        per = max(1, size // max(m, 1))
        for r in range(0, n, per):
            yield r, min(r + per, n), 0, m
