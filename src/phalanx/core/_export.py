"""``phalanx.export``: a stack as one ``torch.export`` graph, for serving (and ONNX).

``torch.export.export(stack, (x,))`` works as it is for the batched backends: the vmapped
forward is traced, with phalanx's batched layers written out as plain operations (torch's
export tracer cannot trace the ``autograd.Function`` they are under vmap; see
``_torch_compat.vmap_rule_inline``). What it cannot always do is keep a dynamic batch: in
torch 2.13 some of torch.func's own batching rules (``avg_pool2d``, for one) turn the batch
size into a Python int under export. :func:`export` tries the stack's own backend first and,
where that trace fails, exports the loop backend instead, saying so: the members one after
another in one graph, exact by construction, every shape as dynamic as asked.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx._errors import summary
from phalanx._warnings import FallbackWarning, warn
from phalanx.core._stack import Stack


def export(
    stack: Stack,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
) -> torch.export.ExportedProgram:
    """Exports ``stack`` as one graph with ``torch.export.export``, its outputs the loop's.

    Put the stack in eval mode first (``stack.eval()``) for serving: in training mode the
    graph would update BatchNorm statistics and draw dropout masks. The program's
    ``module()`` takes the inputs the stack takes and returns ``(N, B, ...)`` outputs; pass it
    to ``torch.onnx.export(program, ..., dynamo=True)`` for ONNX.

    Args:
        stack: the stack to export.
        args: example positional inputs, as for ``stack(*args)``.
        kwargs: example keyword inputs (``{"in_dims": 0}`` for per-member inputs).
        dynamic_shapes: as for ``torch.export.export``, e.g.
            ``{"args": ({0: torch.export.Dim("batch")},)}`` for a dynamic batch.
        strict: passed to ``torch.export.export``.

    Returns:
        The ``torch.export.ExportedProgram``.

    Raises:
        Exception: whatever ``torch.export.export`` raises for the loop backend too, that is
            the member's own code failing to export.

    Example:
        >>> stack = phalanx.stack([nn.Linear(4, 2) for _ in range(3)]).eval()
        >>> batch = torch.export.Dim("batch")
        >>> program = phalanx.export(
        ...     stack, (torch.randn(5, 4),), dynamic_shapes={"args": ({0: batch},)})
        >>> program.module()(torch.randn(7, 4)).shape
        torch.Size([3, 7, 2])
    """
    kwargs = kwargs or {}
    if stack.backend == "loop":
        return _export(stack, args, kwargs, dynamic_shapes, strict)
    try:
        return _export(stack, args, kwargs, dynamic_shapes, strict)
    except Exception as e:  # the batched trace failed: the loop is exact for any member
        reason = summary(e)
    requested = stack.requested_backend
    with stack.using_backend("loop"):  # what auto had learnt stays learnt
        program = _export(stack, args, kwargs, dynamic_shapes, strict)
    warn(
        f"phalanx.export(): backend {requested!r} could not be exported as one batched "
        f"graph ({reason}); the program runs the loop backend's graph instead, the "
        f"{stack.num_members} members one after another: exact, only not batched.",
        FallbackWarning,
    )
    return program


def _export(
    stack: Stack, args: tuple, kwargs: dict, dynamic_shapes: Any, strict: bool
) -> torch.export.ExportedProgram:
    return torch.export.export(
        stack, tuple(args), kwargs, dynamic_shapes=dynamic_shapes, strict=strict
    )
