"""What the captured step's trace must not take in: random streams a graph cannot hold.

A captured graph draws from the global generators (``fallback_random``: eager's numbers);
it cannot draw from a ``torch.Generator`` object the member holds or makes (the trace would
draw once and keep those numbers, or draw from the wrong stream), nor repeat a reseed of the
global generator inside the forward (``torch.manual_seed(k)``: the graph would not reseed).
:class:`RandomWatch` sees both while the step is traced, so the step runs eager instead,
saying why; the member generators the trace drew from are put back (:func:`generator_states`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from phalanx import _torch_compat as compat


class RandomWatch(TorchFunctionMode):
    """Records, while active, a draw from a ``torch.Generator`` object and a reseed of the
    global generators; :attr:`reason` says which, or is None."""

    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None
        self._token: Any = None

    def __enter__(self) -> RandomWatch:
        self._token = compat.seed_token()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self.reason is None and compat.seed_token() != self._token:
            self.reason = (
                "the member's forward reseeds the global generator (torch.manual_seed), "
                "which a captured graph does not repeat"
            )

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.reason is None and isinstance(kwargs.get("generator"), torch.Generator):
            self.reason = (
                f"the member's forward draws from a torch.Generator object of its own "
                f"({getattr(func, '__name__', func)}(generator=...)), whose stream a captured "
                f"graph cannot draw"
            )
        return func(*args, **kwargs)


def generator_states(stack: Any) -> list[tuple[torch.Generator, torch.Tensor]]:
    """Every member generator the stack holds, with its state (to put back after a trace)."""
    seen: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
    for i in range(len(stack)):
        for g in stack.member_generators(i):
            seen.setdefault(id(g), (g, g.get_state()))
    return list(seen.values())


def put_back(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    for g, state in states:
        g.set_state(state)
