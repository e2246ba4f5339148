"""The fused backend: the member's own ``forward`` under vmap, with phalanx's batched layers.

Exact by construction: the forward runs under ``torch.func.vmap`` over the members
(``_vmap.vmapped``), so whatever it does across its batch is per member, and a member's data
turned into a Python value raises where it happens; the layers that hold weights are routed
to batching rules of phalanx's own (``rules.SPEED``), each computing every member exactly as
the layer alone would, errors included. Nothing is checked against a reference at run time,
so there is no first-call check, no per-shape cost and nothing a check could miss.

A plain ``Sequential`` MLP (Linear layers and activations, no hooks) runs as one autograd
node instead (``_fused_mlp``): with a shared input its first layer is one GEMM against every
member's weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from phalanx.backends._fused_mlp import run_mlp
from phalanx.backends._vmap import vmapped
from phalanx.backends.rules import SPEED

if TYPE_CHECKING:
    from phalanx.backends import StackView


class FusedBackend:
    name = "fused"

    def forward(
        self,
        view: StackView,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: tuple[int | None, ...],
        kw_dims: frozenset[str] = frozenset(),
    ) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            out = run_mlp(view, args[0], shared=in_dims[0] is None)
            if out is not None:
                return out
        return vmapped(view, args, kwargs, in_dims, SPEED, self.name, kw_dims)


BACKEND = FusedBackend()
