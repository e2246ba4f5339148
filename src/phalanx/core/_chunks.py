"""The inputs of ``Stack.backward_in_chunks``: cut per chunk, written once, differentiated once.

A chunked step must give each member what one call gives it. Per-member inputs (positional
``in_dims=0``, keyword ``kw_in_dims``) are cut to the chunk's rows. A shared input the forward
writes in place (``x /= 255``) is written by the first chunk only: as the loop's members after
member 0 see the input as given, the later chunks get a copy of it as it was. An input that
requires grad is differentiated chunk by chunk against the chunk's losses; the sum is handed
to autograd once at the end, so a non-leaf input's own graph is traversed once, as one
``backward`` traverses it, and a leaf's ``.grad`` accumulates as ``backward`` accumulates.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx import _torch_compat as compat


class ChunkInputs:
    """A chunked call's inputs: positional ``args`` with ``dims`` and keywords with
    ``kw_dims`` (the per-member names)."""

    def __init__(
        self,
        args: tuple[Any, ...],
        dims: tuple[int | None, ...],
        kwargs: dict[str, Any],
        kw_dims: frozenset[str],
    ) -> None:
        # (key, value, per-member): key an int for a positional input, a str for a keyword
        self.entries: list[tuple[int | str, Any, bool]] = [
            (i, a, d == 0) for i, (a, d) in enumerate(zip(args, dims))
        ]
        self.entries += [(k, v, k in kw_dims) for k, v in kwargs.items()]
        shared = [
            (key, a) for key, a, per in self.entries if not per and isinstance(a, torch.Tensor)
        ]
        self.versions = {key: compat.version(a) for key, a in shared}
        with torch.no_grad():  # what the first chunk may write, as the loop keeps it
            self.before: dict[Any, torch.Tensor] | None = {key: a.clone() for key, a in shared}
        self.originals: dict[Any, torch.Tensor] = {}
        self.fed: list[tuple[Any, torch.Tensor, bool]] = []
        self.grads: dict[Any, list[torch.Tensor]] = {}

    def chunk(self, rows: slice) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The chunk's positional and keyword inputs."""
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        self.fed = []
        for key, a, per in self.entries:
            if per:
                a = a[rows]
            elif key in self.originals:  # written by the first chunk: the input as given
                a = self.originals[key].clone()
            if isinstance(a, torch.Tensor) and a.requires_grad:
                self.fed.append((key, a, per))
            if isinstance(key, int):
                args.append(a)
            else:
                kwargs[key] = a
        return tuple(args), kwargs

    def after_first_chunk(self) -> None:
        """Called after each chunk's forward: the first keeps the inputs it wrote."""
        if self.before is None:
            return
        for key, a, _ in self.entries:
            if key in self.versions and compat.version(a) != self.versions[key]:
                self.originals[key] = self.before[key]
        self.before = None

    def fed_with_grad(self) -> list[torch.Tensor]:
        """The chunk's inputs that require grad, to differentiate the chunk's losses against."""
        return [a for _, a, _ in self.fed]

    def add_grads(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        for (key, a, _), g in zip(self.fed, grads):
            if g is None:
                g = torch.zeros_like(a)
            self.grads.setdefault(key, []).append(g)

    def backward(self) -> None:
        """Hands each input its gradient: the sum over the chunks (shared), or the chunks'
        rows in order (per-member)."""
        tensors, grads = [], []
        for key, a, per in self.entries:
            got = self.grads.get(key)
            if not got:
                continue
            total = torch.cat(got) if per else torch.stack(got).sum(0) if len(got) > 1 else got[0]
            tensors.append(a)
            grads.append(total)
        if tensors:
            torch.autograd.backward(tensors, grads)
