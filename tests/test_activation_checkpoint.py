"""Activation checkpointing inside a member's forward: exact on the loop, refused up front
by the vmap backends (so that ``auto`` hands over), never a crash at backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import phalanx
from helpers import assert_close, assert_members_match
from phalanx.backends import BackendRefusal

N, B = 3, 5


class Checkpointed(nn.Module):
    """A checkpointed block with dropout and BatchNorm (random draws and buffer writes are
    repeated by the recomputation), then an ordinary head."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(
            nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 8)
        )
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


def _members(reentrant: bool) -> list[nn.Module]:
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(Checkpointed(reentrant))
    return out


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("backend", ["loop", "auto"])
def test_checkpointed_member_is_exact_against_the_loop_of_originals(backend, reentrant):
    members = _members(reentrant)
    reference = copy.deepcopy(members)
    stack = phalanx.stack(members, backend=backend)
    x = torch.randn(B, 6, requires_grad=True)
    weights = torch.randn(N, B, 2)

    torch.manual_seed(7)
    expected = torch.stack([m(x) for m in reference])
    (expected * weights).sum().backward()  # reentrant checkpoints refuse autograd.grad
    ref_dx, x.grad = x.grad, None
    ref_rng = torch.get_rng_state()

    torch.manual_seed(7)
    if backend == "auto":  # fused refuses at forward time and says so; the loop runs
        with pytest.warns(UserWarning, match="activation checkpointing"):
            out = stack(x)
    else:
        out = stack(x)
    assert_close(out, expected, msg="outputs")
    (out * weights).sum().backward()
    assert_close(x.grad, ref_dx, msg="input grad")
    assert torch.equal(torch.get_rng_state(), ref_rng), "the recomputation moved the RNG"
    assert_members_match(stack, reference)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("backend", ["vmap", "fused"])
def test_vmap_backends_refuse_checkpointing_at_forward_time(backend, reentrant):
    stack = phalanx.stack(_members(reentrant), backend=backend)
    x = torch.randn(B, 6, requires_grad=True)
    with pytest.raises(BackendRefusal, match=r"(?s)activation checkpointing.*backend='loop'"):
        stack(x)


def test_checkpointing_without_grad_runs_fused():
    # torch.no_grad(): a checkpoint keeps and recomputes nothing, so nothing is refused.
    members = _members(False)
    for m in members:
        m.eval()
    reference = copy.deepcopy(members)
    stack = phalanx.stack(members, backend="fused")
    x = torch.randn(B, 6)
    with torch.no_grad():
        assert_close(stack(x), torch.stack([m(x) for m in reference]), msg="outputs")
