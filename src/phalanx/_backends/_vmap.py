"""The generic backend: ``torch.func.functional_call`` under ``torch.func.vmap``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.func import functional_call, vmap

if TYPE_CHECKING:
    from phalanx._stack import Stack

# Substrings of the errors torch.func raises for code that vmap cannot batch.
_VMAP_LIMITS = (
    "vmap",
    "batched tensor",
    "data-dependent",
    ".item()",
    "randomness",
    "functorch",
)


def is_vmap_limitation(error: BaseException) -> bool:
    """True when ``error`` looks like torch.func refusing the code, not a user bug."""
    text = str(error).lower()
    return any(s in text for s in _VMAP_LIMITS)


class VmapBackend:
    """Runs the member's ``forward`` once under ``vmap`` over the member axis.

    Parameters, buffers and per-member inputs are mapped over dim 0; shared inputs and keyword
    arguments are broadcast. Random operations draw independently for each member
    (``randomness="different"``), reproducibly under ``torch.manual_seed``.
    """

    name = "vmap"

    def forward(
        self,
        stack: Stack,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: tuple[int | None, ...],
    ) -> Any:
        params, buffers = stack._stacked_state()

        def member(params: dict, buffers: dict, *member_args: Any) -> Any:
            return functional_call(stack.module, (params, buffers), member_args, kwargs)

        try:
            return vmap(member, in_dims=(0, 0, *in_dims), randomness="different")(
                params, buffers, *args
            )
        except (RuntimeError, ValueError, NotImplementedError) as e:
            if not is_vmap_limitation(e):
                raise
            raise RuntimeError(
                f"Stack.forward(): backend 'vmap' cannot run this architecture: torch.func.vmap "
                f"refused it with: {e}\nvmap cannot batch data-dependent Python control flow, "
                f".item() or in-place writes into unbatched tensors. Use "
                f"phalanx.stack(models, backend='loop'), or backend='auto', which falls back to "
                f"the loop by itself."
            ) from e


BACKEND = VmapBackend()
