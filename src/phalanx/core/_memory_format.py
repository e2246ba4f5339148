"""Memory formats of stacked tensors: a member's layout, not the stacked tensor's.

``module.to(memory_format=torch.channels_last)`` lays out every 4-D tensor (a Conv2d weight
``(out, in, kh, kw)``) channels-last. A stack's conv weight is ``(N, out, in, kh, kw)``: torch
would refuse it (channels_last wants rank 4), or lay a Conv1d's ``(N, out, in, k)`` out with
the member axis taken for the batch. Here the format is applied to each member's tensor, as
``nn.Module.to`` applies it to the member alone (the tensors whose member shape has 4 or 5
dims), and the members are laid one after another: ``stacked[i]`` is then exactly the
member's tensor in that format, and the values do not change.
"""

from __future__ import annotations

import torch
from torch import nn


def member_format(t: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """``t (N, *shape)`` with each ``t[i]`` in ``memory_format`` (as ``t[i].to(...)``)."""
    member = t[0]
    like = torch.empty_like(member, memory_format=memory_format)  # torch's own rank checks
    if t[0].stride() == like.stride() and t.stride(0) == member.numel():
        return t
    out = torch.empty_strided(
        t.shape, (member.numel(), *like.stride()), dtype=t.dtype, device=t.device
    )
    out.copy_(t)
    return out


def to_member_format(module: nn.Module, memory_format: torch.memory_format) -> None:
    """Lays out ``module``'s stacked parameters, their gradients and buffers member-wise."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.dim() - 1 not in (4, 5):  # nn.Module.to leaves other ranks as they are
                continue
            t.data = member_format(t.data, memory_format)
            if t.grad is not None:
                t.grad = member_format(t.grad, memory_format)
