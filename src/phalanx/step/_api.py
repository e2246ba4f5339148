"""``phalanx.compile_step``: the whole training step captured as one compiled computation.

Tiny members are launch-bound: a training step of 8 networks 10-20-2 is microseconds of
arithmetic under Python, the dispatcher, the autograd engine and the optimizer's bookkeeping.
Here the step (forward through the stack, per-member losses, backward, clipping, isolation
and the optimizer update) is traced once with ``make_fx`` into one graph of aten operations,
backward included, and that graph, taking one flat list of tensors, is handed straight to
the compiler (inductor's ``compile_fx`` by default): called without TorchDynamo's frame
evaluation, guards and pytree flattening, which cost as much as W2's whole compiled step.
Our own input signature is the guard. On CUDA with ``mode="reduce-overhead"`` (CUDA graphs)
it goes through ``torch.compile``, which knows which inputs are static.

The update is the optimizer's own rule (``MemberOptimizer.update``, the pure form of the
``update_`` its eager step runs), so every phalanx optimizer with an update rule is
captured, a rule added later included. An optimizer built with ``fused=True`` promises torch's fused kernel's
bits, which a trace cannot hold (the kernel is one opaque call): there the graph ends at the
clipped gradients and the optimizer's own step applies them, as in the eager step.

The files: this one the public entry point; ``_runner`` the step object (``CompiledStep``);
``_capture`` the trace; ``_graph`` the traced function; ``_compile`` the compiler call;
``_choice`` captured or eager (timing and its record on disk); ``_signature`` the cache key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from phalanx.core._stack import Stack
from phalanx.step._choice import MARGIN, ROUNDS, Prefer, agree, decide
from phalanx.step._runner import CompiledStep

__all__ = ["MARGIN", "ROUNDS", "CompiledStep", "agree", "compile_step", "decide"]

_WHERE = "phalanx.compile_step()"


def compile_step(
    stack: Any,
    loss_fn: Callable[..., Tensor] | None,
    optimizer: torch.optim.Optimizer,
    *,
    in_dims: int | Sequence[int | None] | None = None,
    target_in_dims: int | Literal["same"] | None = "same",
    kw_in_dims: Any = None,
    max_norm: float | Tensor | None = None,
    norm_type: float = 2.0,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    prefer: Prefer = "fastest",
    warmup_steps: int = 1,
) -> CompiledStep:
    """Captures a whole training step of every member as one compiled computation.

    ``step = phalanx.compile_step(stack, loss_fn, opt)`` then ``losses = step(x, y)`` does what
    the eager loop body does (zero the gradients, forward, ``member_losses``, backward, clip,
    ``opt.step(mask=...)``), with forward, backward and update traced into one graph and
    compiled (by inductor, or the backend named). It equals the eager step to float rounding,
    and reads and writes the same tensors: the stack's parameters and buffers and the
    optimizer's state, so eager steps, checkpoints and schedulers mix freely with it. It
    keeps no ``.grad``.

    The first ``warmup_steps`` calls with a new input signature (shapes, dtypes, devices,
    in_dims, train/eval mode) run the eager step; the next call traces and compiles the step
    (the cost, in seconds, is ``step.compile_seconds``) and runs it; the next ten alternate
    captured and eager steps, timed (:data:`ROUNDS` each). With ``prefer="fastest"`` the step
    then keeps the captured step unless its median time is more than 5% over the eager
    step's (:func:`decide`; under ``torch.distributed`` on every rank's medians, the slowest
    rank counting, so every rank makes the same choice) and says which, with both medians,
    in ``step.report``, ``step.eager_seconds`` and ``step.captured_seconds`` and the
    ``phalanx`` logger. The choice is recorded beside inductor's cache
    (``TORCHINDUCTOR_CACHE_DIR``), keyed by the traced graph, its input shapes, torch's
    version, the device and the thread count: a later run of the same step on the same
    machine takes the recorded choice at its first captured call, without timing (delete the
    folder ``phalanx_step_choice`` there to time again). Where capture is impossible it warns
    and runs the eager step.

    Args:
        stack: the :class:`phalanx.Stack` to train.
        loss_fn: a loss on one member's ``(B, ...)`` output and target returning a scalar,
            such as ``torch.nn.functional.cross_entropy`` (see :func:`phalanx.member_losses`);
            the loop's own loss on a member's whole output where that is a tuple, dict,
            registered dataclass or Hugging Face ``ModelOutput`` (``lambda q, y:
            F.mse_loss(q[0], y) + F.mse_loss(q[1], y)``, ``lambda out, y:
            F.cross_entropy(out.logits, y)``); or None for the loss each member computes
            itself (its output's ``.loss``, e.g. a Hugging Face model given ``labels=``):
            call ``step(inputs, labels=y, ...)``.
        optimizer: a phalanx optimizer (``Adam``, ``AdamW``, ``SGD``, ``Lion``, any
            ``MemberOptimizer`` with an update rule) over ``stack.parameters()``, with any
            per-member hyperparameters, ``skip_nonfinite`` and ``freeze_after``; its own
            ``update`` is what the graph runs. Other optimizers run the eager step, with a
            warning.
        in_dims: as in ``Stack.forward``: None (shared input) or 0 (per-member), one per input.
        target_in_dims: None (a target shared by every member) or 0 (per-member); "same"
            (the default) follows ``in_dims`` of a single input.
        kw_in_dims: how the keyword inputs of ``step(...)`` map over the members, as in
            ``Stack.forward``: a dict of name to None or 0, or one value for all.
        max_norm: clip each member's gradient norm to this, a number or (N,), as
            :func:`phalanx.clip_grad_norm_`; the norms are ``step.last_norms``.
        norm_type: the p of the clipping norm.
        backend: ``torch.compile``'s backend; "eager" and "aot_eager" capture without
            generating code (quick to build, for tests and debugging).
        mode: ``torch.compile``'s mode; None gives "reduce-overhead" (CUDA graphs) on CUDA and
            the default on CPU.
        prefer: "fastest" (time both, alternately, and keep the captured step unless it is
            slower) or "captured" (always capture).
        warmup_steps: eager steps before the capture, >= 1 (the first settles the stack's
            backend choice, which must be fixed before tracing).

    Returns:
        The step, a callable ``step(inputs, target=None, *, mask=None, **kwargs) -> (N,)
        losses``.

    Raises:
        TypeError: ``stack`` is not a :class:`phalanx.Stack`.
        ValueError: an argument out of range; the optimizer does not hold the stack's
            parameters.

    Example:
        >>> stack = phalanx.stack([nn.Linear(4, 3) for _ in range(5)])
        >>> opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
        >>> step = phalanx.compile_step(stack, F.cross_entropy, opt, backend="eager")  # or inductor
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> for _ in range(12):  # an eager step, the capture, 5 captured and 5 eager alternating
        ...     losses = step(x, y)
        >>> losses.shape
        torch.Size([5])
        >>> step.report  # the step it kept ("captured" or "eager"), and why
        '...: eager step ... ms, captured step ... ms (medians...), compile ... s'
    """
    if not isinstance(stack, Stack):
        raise TypeError(
            f"{_WHERE}: stack must be a phalanx.Stack; got {type(stack).__name__}. Build one "
            f"with phalanx.stack(models)."
        )
    if prefer not in ("fastest", "captured"):
        raise ValueError(f"{_WHERE}: prefer must be 'fastest' or 'captured'; got {prefer!r}.")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(
            f"{_WHERE}: warmup_steps must be an int >= 1 (the first eager step settles the "
            f"stack's backend before tracing); got {warmup_steps!r}."
        )
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    foreign = [k for k, g in enumerate(optimizer.param_groups) for p in g["params"]
               if id(p) not in {id(q) for q in stack.parameters()}]  # fmt: skip
    missing = [n for n, p in stack.named_parameters() if p.requires_grad and id(p) not in held]
    if foreign or missing:
        raise ValueError(
            f"{_WHERE}: the optimizer must hold exactly the stack's parameters; "
            + (f"the stack's {missing} are missing" if missing else "")
            + ("; " if foreign and missing else "")
            + (f"group(s) {sorted(set(foreign))} hold tensors of another module" if foreign else "")
            + ". Build it with optimizer(stack.parameters())."
        )
    if target_in_dims == "same":
        if in_dims is not None and not isinstance(in_dims, int):
            raise ValueError(
                f"{_WHERE}: with several inputs (in_dims={in_dims!r}) say how the target maps "
                f"over the members: target_in_dims=None (shared) or 0 (per-member)."
            )
        target_in_dims = in_dims
    if target_in_dims not in (None, 0):
        raise ValueError(
            f"{_WHERE}: target_in_dims must be None (shared) or 0 (per-member); got "
            f"{target_in_dims!r}."
        )
    return CompiledStep(
        stack,
        loss_fn,
        optimizer,
        in_dims=in_dims,
        target_in_dims=target_in_dims,
        kw_in_dims=kw_in_dims,
        max_norm=max_norm,
        norm_type=norm_type,
        backend=backend,
        mode=mode,
        prefer=prefer,
        warmup_steps=warmup_steps,
    )
