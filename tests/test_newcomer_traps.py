"""The everyday mistakes a newcomer makes get a warning or an error naming the fix: a
per-member batch passed as shared, per-member targets given as shared, ``stack[i]``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from helpers import assert_close

N, B = 4, 16


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _stack() -> phalanx.Stack:
    torch.manual_seed(0)
    return phalanx.stack([_mlp() for _ in range(N)])


def _hints(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, phalanx.SharedInputWarning)]


# --------------------------------------------------------- a per-member batch passed as shared


def test_a_per_member_batch_without_in_dims_is_warned_naming_in_dims_0():
    stack = _stack()
    with pytest.warns(phalanx.SharedInputWarning, match=r"(?s)\(4, 16, 4\).*in_dims=0.*filterw"):
        out = stack(torch.randn(N, B, 4))
    assert out.shape == (N, N, B, 3)  # it still runs as asked: every member sees all N


def test_the_warning_is_given_once_per_stack():
    stack = _stack()
    xs = torch.randn(N, B, 4)
    assert len(_hints(lambda: [stack(xs) for _ in range(3)])) == 1


def test_after_shared_calls_one_more_dimension_is_warned():
    stack = _stack()
    stack(torch.randn(B, 4))  # a member is given (B, 4): rank 2
    assert len(_hints(lambda: stack(torch.randn(N, B, 4)))) == 1


def test_after_per_member_calls_the_same_input_without_in_dims_is_warned():
    stack = _stack()
    xs = torch.randn(N, B, 4)
    stack(xs, in_dims=0)  # trains per member ...
    assert len(_hints(lambda: stack(xs))) == 1  # ... and evaluates forgetting in_dims
    stack2 = _stack()
    ys = torch.randn(N, 4)  # a member is given one sample (4,)
    stack2(ys, in_dims=0)
    assert len(_hints(lambda: stack2(ys))) == 1


def test_a_shared_batch_whose_size_is_n_is_not_warned():
    stack = _stack()
    assert _hints(lambda: stack(torch.randn(N, 4))) == []  # 2-D, no history: a batch of N
    assert _hints(lambda: stack(torch.randn(B, 4))) == []
    assert _hints(lambda: stack(torch.randn(N, 4))) == []  # same rank as before
    # a sequence batch (B, T, d), the last one of N rows: the member's rank is 3 already
    seq = phalanx.stack([nn.Linear(4, 3) for _ in range(N)])
    seq(torch.randn(B, 7, 4))
    assert _hints(lambda: seq(torch.randn(N, 7, 4))) == []


def test_the_warning_is_silenced_by_its_class():
    stack = _stack()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=phalanx.SharedInputWarning)
        stack(torch.randn(N, B, 4))


# ------------------------------------------------------- per-member targets declared shared


def test_per_member_class_targets_without_in_dims_name_in_dims_0_0():
    stack = _stack()
    out = stack(torch.randn(N, B, 4), in_dims=0)
    ys = torch.randint(0, 3, (N, B))
    with pytest.raises(ValueError, match=r"member_losses\(\).*\(4, 16\).*in_dims=\(0, 0\)"):
        phalanx.member_losses(F.cross_entropy, out, ys)
    losses = phalanx.member_losses(F.cross_entropy, out, ys, in_dims=(0, 0))
    for i in range(N):
        assert_close(losses[i], F.cross_entropy(out[i], ys[i]))


def test_per_member_regression_targets_of_another_width_name_in_dims_0_0():
    stack = phalanx.stack([nn.Linear(4, 3) for _ in range(N)])
    out = stack(torch.randn(N, B, 4), in_dims=0)  # (N, B, 3)
    with pytest.raises(ValueError, match=r"in_dims=\(0, 0\)"):
        phalanx.member_losses(F.mse_loss, out, torch.randn(N, B, 1))  # broadcast target


def test_a_shared_target_declared_per_member_names_the_default():
    stack = _stack()
    out = stack(torch.randn(B, 4))
    with pytest.raises(ValueError, match=r"per-member.*\(16,\).*in_dims=\(0, None\)"):
        phalanx.member_losses(F.cross_entropy, out, torch.randint(0, 3, (B,)), in_dims=(0, 0))


def test_shared_targets_that_begin_with_n_still_run():
    stack = _stack()
    out = stack(torch.randn(N, 4))  # a shared batch of N rows: output (N, N, 3)
    y = torch.randint(0, 3, (N,))
    losses = phalanx.member_losses(F.cross_entropy, out, y)
    assert_close(losses[1], F.cross_entropy(out[1], y))


def test_the_first_call_reads_the_rank_of_a_batch_from_the_first_layer():
    torch.manual_seed(0)
    conv = phalanx.stack([nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten()) for _ in range(3)])
    assert _hints(lambda: conv(torch.randn(3, 1, 6, 6))) == []  # a shared image batch of 3
    conv2 = phalanx.stack([nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten()) for _ in range(3)])
    assert len(_hints(lambda: pytest.raises(RuntimeError, conv2, torch.randn(3, 5, 1, 6, 6)))) == 1
    emb = phalanx.stack([nn.Embedding(10, 4) for _ in range(3)])
    assert _hints(lambda: emb(torch.randint(0, 10, (3, 7)))) == []  # ids (B, T), B = N
    emb2 = phalanx.stack([nn.Embedding(10, 4) for _ in range(3)])
    assert len(_hints(lambda: emb2(torch.randint(0, 10, (3, 5, 7))))) == 1
