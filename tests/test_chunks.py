"""Member chunking (``Stack.backward_in_chunks``): each member's gradients against the unchunked
step (bit for bit on the loop and vmap backends, to float rounding against the float64 loop on
fused), buffers, accumulation, per-member inputs, padded stacks, and the errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.testing import assert_close, assert_equal_to_loop


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)
    )


def grads(stack: phalanx.Stack) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in stack.module.named_parameters()}


@pytest.mark.parametrize("backend", ["loop", "vmap"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_chunked_gradients_are_the_unchunked_bit_for_bit(backend: str, k: int) -> None:
    """Bit for bit on one intra-op thread: with more, a batched kernel splits its work over the
    threads by its size, so k members and N may sum in another order (the claim of
    backward_in_chunks' docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _chunked_equals_unchunked(backend, k)
    finally:
        torch.set_num_threads(threads)


def _chunked_equals_unchunked(backend: str, k: int) -> None:
    torch.manual_seed(0)
    models = [mlp() for _ in range(7)]
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    whole = phalanx.stack(models, backend=backend)
    losses = phalanx.member_losses(F.cross_entropy, whole(x), y)
    losses.sum().backward()
    chunked = phalanx.stack(models, backend=backend)
    got = chunked.backward_in_chunks(
        lambda out, rows: phalanx.member_losses(F.cross_entropy, out, y), x, chunk_members=k
    )
    assert torch.equal(got, losses.detach())
    for name, g in grads(whole).items():
        assert torch.equal(chunked.module.get_parameter(name).grad, g), name
    # a second call accumulates, as a second backward does
    phalanx.member_losses(F.cross_entropy, whole(x), y).sum().backward()
    chunked.backward_in_chunks(
        lambda out, rows: phalanx.member_losses(F.cross_entropy, out, y), x, chunk_members=k
    )
    for name, g in grads(whole).items():
        assert torch.equal(chunked.module.get_parameter(name).grad, g), name


@pytest.mark.parametrize("backend", ["fused", "auto"])
def test_chunked_fused_gradients_equal_the_loop_to_rounding(backend: str) -> None:
    torch.manual_seed(0)
    models = [mlp() for _ in range(6)]
    xs, y = torch.randn(6, 32, 6), torch.randint(0, 3, (6, 32))
    stack = phalanx.stack(models, backend=backend)
    stack.backward_in_chunks(
        lambda out, rows: phalanx.member_losses(F.cross_entropy, out, y[rows], in_dims=(0, 0)),
        xs,
        chunk_members=4,
        in_dims=0,
    )
    alone, wide = [copy.deepcopy(m) for m in models], [copy.deepcopy(m).double() for m in models]
    for i in range(6):
        F.cross_entropy(alone[i](xs[i]), y[i]).backward()
        F.cross_entropy(wide[i](xs[i].double()), y[i]).backward()
    for name, p in stack.module.named_parameters():
        loop = torch.stack([m.get_parameter(name).grad for m in alone])
        reference = torch.stack([m.get_parameter(name).grad for m in wide])
        assert_equal_to_loop(p.grad, loop, reference, what=name, per_member=True)


def test_batchnorm_statistics_and_gradients_follow_the_chunks() -> None:
    torch.manual_seed(0)
    models = [cnn() for _ in range(5)]
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
    whole = phalanx.stack(models, backend="loop")
    phalanx.member_losses(F.cross_entropy, whole(x), y).sum().backward()
    chunked = phalanx.stack(models, backend="loop")
    chunked.backward_in_chunks(
        lambda out, rows: phalanx.member_losses(F.cross_entropy, out, y), x, chunk_members=2
    )
    for (name, a), b in zip(whole.module.named_buffers(), chunked.module.buffers()):
        assert torch.equal(a, b), name
    for name, g in grads(whole).items():
        assert torch.equal(chunked.module.get_parameter(name).grad, g), name


@pytest.mark.parametrize("backend", ["loop", "fused"])
def test_a_padded_stack_in_chunks_keeps_its_padded_gradients_zero(backend: str) -> None:
    torch.manual_seed(0)
    widths = [3, 9, 5, 7]
    models = [nn.Sequential(nn.Linear(6, w), nn.Sigmoid(), nn.Linear(w, 3)) for w in widths]
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    whole = phalanx.stack(models, pad_widths=True, backend=backend)
    phalanx.member_losses(F.cross_entropy, whole(x), y).sum().backward()
    chunked = phalanx.stack(models, pad_widths=True, backend=backend)
    chunked.backward_in_chunks(
        lambda out, rows: phalanx.member_losses(F.cross_entropy, out, y), x, chunk_members=3
    )
    for name, g in grads(whole).items():
        got = chunked.module.get_parameter(name).grad
        if backend == "loop":
            assert torch.equal(got, g), name
        else:  # fused: one GEMM over the chunk's members sums in another order
            assert_close(got, g, msg=name)
        mask = chunked.padding.mask(name, got)
        assert torch.equal(got[~mask], torch.zeros_like(got[~mask])), name


def test_errors_name_what_is_wrong() -> None:
    stack = phalanx.stack([nn.Linear(4, 3) for _ in range(4)])
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError, match=r"chunk_members must be a positive int; got 0"):
        stack.backward_in_chunks(lambda out, rows: out.sum(), x, chunk_members=0)
    with pytest.raises(ValueError, match=r"shape \(2,\) for members 0\.\.1; got \(\)"):
        stack.backward_in_chunks(lambda out, rows: F.cross_entropy(out[0], y), x, chunk_members=2)
