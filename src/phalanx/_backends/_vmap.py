"""The generic backend: ``torch.func.functional_call`` under ``torch.func.vmap``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.func import functional_call, vmap

from phalanx._backends import BackendRefusal

if TYPE_CHECKING:
    from phalanx._backends import StackView


class VmapBackend:
    """Runs the member's ``forward`` once under ``vmap`` over the member axis.

    Parameters, buffers and per-member inputs are mapped over dim 0; shared inputs and keyword
    arguments are broadcast. Random operations draw independently for each member
    (``randomness="different"``), reproducibly under ``torch.manual_seed``.
    """

    name = "vmap"

    def forward(
        self,
        view: StackView,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: tuple[int | None, ...],
    ) -> Any:
        params, buffers = view.state()
        if torch.is_autocast_enabled("cpu"):
            # torch.func.vmap runs the member in float32 under CPU autocast, where the member
            # alone computes in the autocast dtype: not the loop's answer.
            raise BackendRefusal(
                "Stack.forward(): backend 'vmap' cannot run under CPU autocast: torch.func.vmap "
                "computes the member in float32 there, the member alone in the autocast dtype. "
                "Use backend='fused' or backend='loop', or backend='auto', which hands over by "
                "itself."
            )

        if 0 in in_dims and any(
            isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.padding_idx is not None
            for m in view.module.modules()
        ):
            # Measured with torch 2.13: under vmap with per-member indices, the gradient of an
            # embedding's padding_idx row is not zero (torch.func's batching rule for the
            # embedding backward drops padding_idx), a silently wrong gradient.
            raise BackendRefusal(
                "Stack.forward(): backend 'vmap' cannot run an Embedding with padding_idx on "
                "per-member indices: torch.func.vmap gives the padding row a gradient. Use "
                "backend='fused' or backend='loop', or backend='auto', which hands over by itself."
            )

        def member(params: dict, buffers: dict, *member_args: Any) -> Any:
            return functional_call(view.module, (params, buffers), member_args, kwargs)

        try:
            return vmap(member, in_dims=(0, 0, *in_dims), randomness="different")(
                params, buffers, *args
            )
        except (RuntimeError, ValueError, NotImplementedError) as e:
            # Whatever torch.func says (a missing batching rule, data-dependent control flow,
            # .item(), an in-place write into an unbatched tensor), the loop runs the member's
            # code as written: refuse, and let the caller hand over.
            raise BackendRefusal(
                f"Stack.forward(): backend 'vmap' cannot run this architecture: torch.func.vmap "
                f"raised {type(e).__name__}: {str(e).strip().splitlines()[0]}\nUse "
                f"phalanx.stack(models, backend='loop'), or backend='auto', which hands over to "
                f"the loop by itself."
            ) from e


BACKEND = VmapBackend()
