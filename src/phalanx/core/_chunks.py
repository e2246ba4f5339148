"""The inputs of ``Stack.backward_in_chunks``: cut per chunk, written once, differentiated once.

A chunked step must give each member what one call gives it. Per-member inputs (positional
``in_dims=0``, keyword ``kw_in_dims``) are cut to the chunk's rows. A shared input the forward
writes in place (``x /= 255``) is written by the first chunk only: as the loop's members after
member 0 see the input as given, the later chunks get a copy of it as it was. An input that
requires grad gets the gradient of every chunk's losses: a leaf's ``.grad`` accumulates as
``backward`` accumulates; a non-leaf input is fed to the chunks as a detached stand-in (one
for the call, a leaf), whose gradient is handed to the input's own graph once at the end, so
that graph is traversed once, as one ``backward`` traverses it.
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
        chunks: int,
    ) -> None:
        # (key, value, per-member): key an int for a positional input, a str for a keyword
        self.entries: list[tuple[int | str, Any, bool]] = [
            (i, a, d == 0) for i, (a, d) in enumerate(zip(args, dims))
        ]
        self.entries += [(k, v, k in kw_dims) for k, v in kwargs.items()]
        # A non-leaf input that requires grad: the chunks read a leaf stand-in (sharing its
        # memory and version counter, so in-place writes land in the input as given).
        self.stand_ins: dict[int | str, tuple[torch.Tensor, torch.Tensor]] = {}
        for n, (key, a, per) in enumerate(self.entries):
            if isinstance(a, torch.Tensor) and a.requires_grad and not a.is_leaf:
                stand = a.detach().requires_grad_()
                self.stand_ins[key] = (a, stand)
                self.entries[n] = (key, stand, per)
        shared = [
            (key, a)
            for key, a, per in self.entries
            if not per and isinstance(a, torch.Tensor) and chunks > 1  # one chunk: one call
        ]
        self.versions = {key: compat.version(a) for key, a in shared}
        with torch.no_grad():  # what the first chunk may write, as the loop keeps it
            self.before: dict[Any, torch.Tensor] | None = {key: a.clone() for key, a in shared}
        self.originals: dict[Any, torch.Tensor] = {}

    def chunk(self, rows: slice) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The chunk's positional and keyword inputs."""
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for key, a, per in self.entries:
            if per:
                a = a[rows]
            elif key in self.originals:  # written by the first chunk: the input as given
                a = self.originals[key].clone()
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

    def backward(self) -> None:
        """Hands each non-leaf input the gradient its stand-in gathered over the chunks."""
        pairs = [(a, s.grad) for a, s in self.stand_ins.values() if s.grad is not None]
        if pairs:
            torch.autograd.backward([a for a, _ in pairs], [g for _, g in pairs])
