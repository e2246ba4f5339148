"""Loss scaling per member for float16 mixed precision: one member's overflow skips only its step.

``torch.amp.GradScaler`` keeps one scale and one inf check for a whole optimizer: when one
member's gradients overflow it skips every member's step and halves the one scale. Here
each member has its own scale, its own inf check and its own growth, exactly as a
``torch.amp.GradScaler`` of its own would have, and the members that did not overflow step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from phalanx.optim import MemberOptimizer
from phalanx.optim._arith import finite_members

__all__ = ["MemberGradScaler"]

_WHERE = "phalanx.MemberGradScaler"


class MemberGradScaler:
    """``torch.amp.GradScaler`` with one scale per member: an (N,) scale, inf check and growth.

    Use it as torch's scaler, with the per-member losses: ``scaler.scale(losses)`` takes the
    (N,) losses and returns ``sum_i losses[i] * scale[i]`` to backpropagate;
    ``scaler.unscale_(opt)`` divides member i's gradients by its own scale (before
    ``phalanx.clip_grad_norm_``); ``scaler.step(opt)`` steps the members whose gradients are
    finite (a phalanx optimizer's ``mask=``), so a member that overflowed keeps its weights and
    optimizer state; ``scaler.update()`` backs off the scale of each member that overflowed
    and grows, after ``growth_interval`` clean steps in a row, each member's own. Member i
    then sees exactly what a ``torch.amp.GradScaler`` of its own does to it alone.

    Args:
        num_members: N.
        device: the device of the scale tensors ("cuda", "cpu", ...).
        init_scale: every member's first scale.
        growth_factor: multiplies a member's scale after ``growth_interval`` clean steps.
        backoff_factor: multiplies a member's scale after a step whose gradients overflowed.
        growth_interval: clean steps in a row before a member's scale grows.
        enabled: False makes every method a pass-through (``scale`` returns the sum of the
            losses, ``step`` steps every member), as torch's ``enabled=False``.

    Attributes:
        last_skipped: (N,) bool, the members whose step the last ``step`` skipped.

    Example:
        >>> stack = phalanx.stack([nn.Linear(4, 1) for _ in range(3)])
        >>> opt = phalanx.optim.SGD(stack.parameters(), lr=0.1)
        >>> scaler = phalanx.MemberGradScaler(3, device="cpu", init_scale=1024.0)
        >>> losses = phalanx.member_losses(F.mse_loss, stack(torch.randn(8, 4)), torch.randn(8, 1))
        >>> scaler.scale(losses * torch.tensor([1.0, float("inf"), 1.0])).backward()
        >>> scaler.step(opt)  # member 1 overflowed: only members 0 and 2 step
        >>> scaler.update()
        >>> scaler.get_scale()
        tensor([1024.,  512., 1024.])
    """

    def __init__(
        self,
        num_members: int,
        device: str | torch.device = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if isinstance(num_members, bool) or not isinstance(num_members, int) or num_members < 1:
            raise ValueError(
                f"{_WHERE}(): num_members must be a positive int; got {num_members!r}."
            )
        if not growth_factor > 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(
                f"{_WHERE}(): growth_factor must be > 1 and backoff_factor in (0, 1), as torch's "
                f"GradScaler requires; got {growth_factor} and {backoff_factor}."
            )
        if isinstance(growth_interval, bool) or growth_interval < 1:
            raise ValueError(
                f"{_WHERE}(): growth_interval must be a positive int; got {growth_interval!r}."
            )
        self.num_members = num_members
        self.device = torch.device(device)
        self._enabled = enabled
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._scale = torch.full((num_members,), self._init_scale, device=self.device)
        self._growth_tracker = torch.zeros(num_members, dtype=torch.int32, device=self.device)
        self.last_skipped = torch.zeros(num_members, dtype=torch.bool, device=self.device)
        # per optimizer (by id) this iteration: {"unscaled": bool, "found_inf": (N,) bool}
        self._per_optimizer: dict[int, dict[str, Any]] = {}

    def is_enabled(self) -> bool:
        """Whether the scaler scales (``enabled=True``)."""
        return self._enabled

    def scale(self, losses: Tensor) -> Tensor:
        """``sum_i losses[i] * scale[i]``, the scalar to backpropagate.

        Args:
            losses: (N,) the members' losses (``phalanx.member_losses``).

        Returns:
            A scalar: each member's loss times its own scale, summed.

        Raises:
            ValueError: ``losses`` is not of shape (N,): one summed loss cannot be scaled per
                member.
        """
        if not isinstance(losses, Tensor) or losses.shape != (self.num_members,):
            got = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(
                f"{_WHERE}.scale(): expected the per-member losses, shape ({self.num_members},), "
                f"one per member; got {got}. A summed loss cannot be scaled per member: pass "
                f"phalanx.member_losses(...) (or the model's own out.loss) before summing."
            )
        if not self._enabled:
            return losses.sum()
        return (losses * self._scale.to(losses.device)).sum()

    def _state(self, optimizer: Any) -> dict[str, Any]:
        return self._per_optimizer.setdefault(id(optimizer), {"unscaled": False, "found_inf": None})

    def unscale_(self, optimizer: Any) -> None:
        """Divides each member's gradients by its own scale, in place, once per step.

        As torch's: multiplied by the reciprocal of the scale computed in float64, and each
        member's non-finite gradients recorded for ``step``.

        Raises:
            TypeError: ``optimizer`` is not a phalanx optimizer (no per-member step mask).
            RuntimeError: ``unscale_`` was already called for this optimizer since ``update``.
        """
        if not self._enabled:
            return
        _check_optimizer(optimizer, "unscale_")
        state = self._state(optimizer)
        if state["unscaled"]:
            raise RuntimeError(
                f"{_WHERE}.unscale_(): already called on this optimizer since the last update()."
            )
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if any(g.dtype == torch.float16 for g in grads):
            raise ValueError(f"{_WHERE}.unscale_(): attempting to unscale FP16 gradients.")
        inv = self._scale.double().reciprocal().float()  # as torch's GradScaler rounds it
        state["found_inf"] = ~finite_members(grads, self.num_members, self.device)
        with torch.no_grad():
            for g in grads:
                g.mul_(inv.to(g.device).view(-1, *([1] * (g.dim() - 1))))
        state["unscaled"] = True

    def step(
        self, optimizer: Any, closure: Callable[[], Any] | None = None, *, mask: Any = None
    ) -> Any:
        """Unscales (if not done yet) and steps the members whose gradients are finite.

        Args:
            optimizer: a phalanx optimizer.
            closure: as ``optimizer.step``'s.
            mask: (N,) bool, members to step at all (e.g. early stopping's); the scaler also
                leaves out the members that overflowed.

        Returns:
            What ``optimizer.step`` returns.
        """
        if not self._enabled:
            return optimizer.step(closure, mask=mask)
        _check_optimizer(optimizer, "step")
        state = self._state(optimizer)
        if not state["unscaled"]:
            self.unscale_(optimizer)
        self.last_skipped = state["found_inf"].clone()
        # Always the masked step: asking whether any member overflowed would be a host sync
        # (torch's GradScaler makes one); the mask is read on the device.
        active = ~state["found_inf"]
        if mask is not None:
            active = active & torch.as_tensor(mask, dtype=torch.bool, device=active.device)
        return optimizer.step(closure, mask=active)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Backs off the scale of each member that overflowed this step, grows the others'.

        Args:
            new_scale: sets every member's scale to a number, or to an (N,) tensor, instead.

        Raises:
            RuntimeError: no ``unscale_`` or ``step`` since the last update.
        """
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale.copy_(
                torch.as_tensor(new_scale, dtype=torch.float32).expand_as(self._scale)
            )
            self._per_optimizer = {}
            return
        found = [s["found_inf"] for s in self._per_optimizer.values() if s["found_inf"] is not None]
        if not found:
            raise RuntimeError(
                f"{_WHERE}.update(): no inf checks were recorded since the last update; call "
                "scaler.step(optimizer) (or unscale_) first."
            )
        found_inf = torch.stack(found).any(dim=0)
        # torch._amp_update_scale_, one member per element: the products in float64, rounded
        # to float32 as its kernel rounds them, and a grown scale kept only if finite
        grown = self._growth_tracker + 1
        grow = ~found_inf & (grown == self._growth_interval)
        bigger = (self._scale.double() * self._growth_factor).float()
        grow &= bigger.isfinite()
        smaller = (self._scale.double() * self._backoff_factor).float()
        self._scale = torch.where(found_inf, smaller, torch.where(grow, bigger, self._scale))
        tracker = torch.where(grown == self._growth_interval, 0, grown).to(torch.int32)
        self._growth_tracker = torch.where(found_inf, 0, tracker).to(torch.int32)
        self._per_optimizer = {}

    def get_scale(self) -> Tensor:
        """(N,) each member's scale (a copy); ones when disabled."""
        return self._scale.clone() if self._enabled else torch.ones(self.num_members)

    def get_growth_tracker(self) -> Tensor:
        """(N,) each member's count of clean steps since its scale last changed."""
        return self._growth_tracker.clone()

    def keep_members(self, members: Any) -> None:
        """Keeps only these members' scales, in this order (follows ``opt.keep_members``)."""
        index = torch.as_tensor(members, dtype=torch.long, device=self.device)
        self._scale = self._scale[index]
        self._growth_tracker = self._growth_tracker[index]
        self.last_skipped = self.last_skipped[index]
        self.num_members = int(index.numel())

    def state_dict(self) -> dict[str, Any]:
        """The scales, growth trackers and settings: tensors and numbers, for ``phalanx.save``
        (as an extra: ``phalanx.save(path, stack, scaler=scaler.state_dict())``) or
        ``torch.save``."""
        if not self._enabled:
            return {}
        return {
            "scale": self._scale.detach().cpu().clone(),
            "growth_tracker": self._growth_tracker.detach().cpu().clone(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what ``state_dict`` saved.

        Raises:
            RuntimeError: the state is empty (saved disabled) while this scaler is enabled.
            ValueError: the state holds another number of members.
        """
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError(
                f"{_WHERE}.load_state_dict(): the state is empty: it was saved by a disabled "
                "scaler."
            )
        scale = torch.as_tensor(state_dict["scale"], dtype=torch.float32)
        if scale.shape != (self.num_members,):
            raise ValueError(
                f"{_WHERE}.load_state_dict(): the state holds {tuple(scale.shape)} scales, this "
                f"scaler has {self.num_members} members; build it with the saved number."
            )
        self._scale = scale.to(self.device).clone()
        tracker = torch.as_tensor(state_dict["growth_tracker"], dtype=torch.int32)
        self._growth_tracker = tracker.to(self.device).clone()
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])


def _check_optimizer(optimizer: Any, method: str) -> None:
    if not isinstance(optimizer, MemberOptimizer):
        raise TypeError(
            f"{_WHERE}.{method}(): expected a phalanx optimizer (a phalanx.optim."
            f"MemberOptimizer), whose step takes a per-member mask; got {type(optimizer).__name__}. A "
            f"torch optimizer can only skip every member's step at once."
        )
