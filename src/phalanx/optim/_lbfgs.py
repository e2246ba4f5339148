"""L-BFGS with one history and one line search per member, each exactly torch's.

``torch.optim.LBFGS`` over stacked parameters treats the N members as one vector: one history,
one line search and one step length for all, so members couple (changing one member's loss
moves the others). Here every member has its own ``torch.optim.LBFGS``, run unchanged on its
own leaf copy of its rows: what it computes is what torch computes for that member alone,
by construction. What stays batched is the expensive part, the closure: each of torch's
calls to a member's closure waits until every member still running has asked for an
evaluation, then one call of the user's closure evaluates all of them at once.

Torch's LBFGS calls the closure from inside its ``step``, so each member's ``step`` runs on a
thread of its own, and the members take turns: exactly one runs at a time, until it asks
for an evaluation or finishes. The threads only pass control; no two compute at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["LBFGS"]


class _Abort(Exception):
    """Ends a member's step when the shared evaluation failed."""


class LBFGS(torch.optim.Optimizer):
    """L-BFGS over stacked parameters, every member with its own history and line search.

    Member i follows exactly the iterates of ``torch.optim.LBFGS`` run on member i alone with
    the same arguments, given the same losses and gradients: each member runs its own torch
    LBFGS (on a copy of its rows), so its history, its line search, its step lengths and its
    stopping tests are its own. Only the closure is shared: it evaluates every member at the
    points the members' line searches ask for, in one batched call.

    Args:
        params: stacked parameters, each of shape (N, *shape).
        lr: learning rate (the line search's initial step), a number or one per member
            (a tensor, list or tuple of N).
        max_iter, max_eval, tolerance_grad, tolerance_change, history_size, line_search_fn:
            as ``torch.optim.LBFGS``, for every member.

    Example:
        >>> stack = phalanx.stack([nn.Linear(4, 1) for _ in range(3)])
        >>> x, y = torch.randn(32, 4), torch.randn(32, 1)
        >>> opt = phalanx.optim.LBFGS(stack.parameters(), line_search_fn="strong_wolfe")
        >>> def closure():
        ...     opt.zero_grad()
        ...     losses = phalanx.member_losses(F.mse_loss, stack(x), y)  # (N,), one per member
        ...     losses.sum().backward()
        ...     return losses
        >>> before = opt.step(closure)  # (N,) each member's loss before its step
        >>> after = phalanx.metrics.loss(F.mse_loss, stack(x), y)
        >>> bool((after < before).all())
        True
    """

    _NAME = "phalanx.optim.LBFGS"

    def __init__(
        self,
        params: Any,
        lr: float | Tensor | Sequence[float] = 1.0,
        max_iter: int = 20,
        max_eval: int | None = None,
        tolerance_grad: float = 1e-7,
        tolerance_change: float = 1e-9,
        history_size: int = 100,
        line_search_fn: str | None = None,
    ) -> None:
        params = list(params)
        if not params or not all(isinstance(p, Tensor) and p.dim() > 0 for p in params):
            raise ValueError(
                f"{self._NAME}(): expected stacked parameters, each of shape (N, *shape), as "
                "phalanx.stack(models).parameters() are."
            )
        n = params[0].shape[0]
        bad = [j for j, p in enumerate(params) if p.shape[0] != n]
        if bad:
            raise ValueError(
                f"{self._NAME}(): parameters {bad} do not have {n} members on dim 0, as "
                "parameter 0 has; every parameter must be stacked with the member axis first."
            )
        lrs = torch.as_tensor(lr, dtype=torch.float64).reshape(-1)
        if lrs.numel() not in (1, n):
            raise ValueError(
                f"{self._NAME}(): lr must be a number or one per member ({n}); got {lrs.numel()} "
                "values."
            )
        kwargs = {
            "max_iter": max_iter,
            "max_eval": max_eval,
            "tolerance_grad": tolerance_grad,
            "tolerance_change": tolerance_change,
            "history_size": history_size,
            "line_search_fn": line_search_fn,
        }
        defaults = {"lr": float(lrs[0]) if lrs.numel() == 1 else lrs, **kwargs}
        super().__init__(params, defaults)
        self.num_members = n
        # each member's own leaves and its own torch LBFGS over them
        self.leaves = [
            [p.detach()[i].clone().requires_grad_(p.requires_grad) for p in params]
            for i in range(n)
        ]
        lr_of = [float(lrs[i if lrs.numel() > 1 else 0]) for i in range(n)]
        self.members = [
            torch.optim.LBFGS(self.leaves[i], lr=lr_of[i], **kwargs)  # type: ignore[arg-type]
            for i in range(n)
        ]

    def _params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def step(self, closure: Callable[[], Tensor]) -> Tensor:  # type: ignore[override]
        """Runs each member's L-BFGS step (up to ``max_iter`` iterations, its line search).

        Args:
            closure: zeroes the gradients, evaluates every member, backpropagates the sum of
                the members' losses and returns the (N,) per-member losses.

        Returns:
            (N,) each member's loss at the start of the step, as torch's step returns it.

        Raises:
            ValueError: the closure does not return (N,) per-member losses.
            Exception: whatever the closure raises; the stack then holds the members' last
                points.
        """
        params = self._params()
        n = self.num_members
        with torch.no_grad():  # the stack may have changed since the last step
            for i, leaves in enumerate(self.leaves):
                for leaf, p in zip(leaves, params, strict=True):
                    leaf.copy_(p[i])
        turn = threading.Condition()
        waiting: set[int] = set()
        done: set[int] = set()
        running: list[int | None] = [None]  # the member whose turn it is
        evaluated: dict[int, Tensor] = {}
        failure: list[BaseException] = []
        abort = [False]
        results: list[Any] = [None] * n

        def member_closure(i: int) -> Tensor:
            with torch.no_grad():
                for leaf, p in zip(self.leaves[i], params, strict=True):
                    p[i] = leaf
            with turn:
                waiting.add(i)
                running[0] = None
                turn.notify_all()
                turn.wait_for(lambda: running[0] == i or abort[0])
                if abort[0]:
                    raise _Abort
            for leaf, p in zip(self.leaves[i], params, strict=True):
                leaf.grad = None if p.grad is None else p.grad[i].clone()
            return evaluated.pop(i)

        def run(i: int) -> None:
            with turn:
                turn.wait_for(lambda: running[0] == i or abort[0])
            try:
                if not abort[0]:
                    results[i] = self.members[i].step(lambda: member_closure(i))
            except _Abort:
                pass
            except BaseException as e:  # handed to the caller's thread
                failure.append(e)
            finally:
                with torch.no_grad():
                    for leaf, p in zip(self.leaves[i], params, strict=True):
                        p[i] = leaf
                with turn:
                    done.add(i)
                    running[0] = None
                    turn.notify_all()

        def idle() -> bool:
            return running[0] is None

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        try:
            pending = list(range(n))  # members to give a turn before the next evaluation
            while True:
                for i in pending:
                    with turn:
                        running[0] = i
                        turn.notify_all()
                        turn.wait_for(idle)
                    if failure:
                        raise failure[0]
                pending = sorted(waiting)
                if not pending:
                    break
                with torch.enable_grad():
                    losses = closure()
                self._check_losses(losses)
                for i in pending:
                    evaluated[i] = losses.detach()[i]
                waiting.clear()
        finally:
            with turn:
                abort[0] = True
                turn.notify_all()
            for t in threads:
                t.join()
        if failure:
            raise failure[0]
        return torch.stack([torch.as_tensor(r) for r in results])

    def _check_losses(self, losses: Any) -> None:
        if not isinstance(losses, Tensor) or losses.shape != (self.num_members,):
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(
                f"{self._NAME}.step(): the closure must return the ({self.num_members},) "
                f"per-member losses (after backpropagating their sum); got {shape}. Each "
                "member's line search needs its own loss."
            )

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus every member's torch LBFGS state (history, step
        length, counters) under "members", for ``torch.save``. (``phalanx.save`` refuses it: the
        members' histories differ in length, which its format of stacked tensors cannot hold.)
        """
        return {**super().state_dict(), "members": [m.state_dict() for m in self.members]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what ``state_dict`` saved, member by member."""
        state_dict = dict(state_dict)
        members = state_dict.pop("members")
        if len(members) != self.num_members:
            raise ValueError(
                f"{self._NAME}.load_state_dict(): the state holds {len(members)} members, this "
                f"optimizer {self.num_members}."
            )
        super().load_state_dict(state_dict)
        for m, s in zip(self.members, members, strict=True):
            m.load_state_dict(s)
