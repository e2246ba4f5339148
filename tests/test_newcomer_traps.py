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


def test_a_member_rank_is_learned_from_the_first_call_at_its_position():
    # the rank is written once per position (no write per input per call): a later call
    # of another rank does not overwrite what a member was first given
    stack = _stack()
    xs = torch.randn(N, B, 4)
    stack(xs, in_dims=0)  # a member is given (B, 4): rank 2
    stack(torch.randn(B, 7, 4), in_dims=(None,))  # shared, rank 3, not N rows
    assert len(_hints(lambda: stack(xs))) == 1


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

    def five_d() -> None:
        with pytest.raises(RuntimeError):  # torch's conv refuses 5-D; the hint came first
            conv2(torch.randn(3, 5, 1, 6, 6))

    assert len(_hints(five_d)) == 1
    emb = phalanx.stack([nn.Embedding(10, 4) for _ in range(3)])
    assert _hints(lambda: emb(torch.randint(0, 10, (3, 7)))) == []  # ids (B, T), B = N
    emb2 = phalanx.stack([nn.Embedding(10, 4) for _ in range(3)])
    assert len(_hints(lambda: emb2(torch.randint(0, 10, (3, 5, 7))))) == 1


# ------------------------------------------------------------------------------- stack[i]


def test_stack_i_is_member_i_as_an_ordinary_module_negative_indices_too():
    members = [_mlp() for _ in range(N)]
    stack = phalanx.stack(members)
    x = torch.randn(B, 4)
    out = stack(x)
    for i in range(-N, N):
        m = stack[i]
        assert type(m) is nn.Sequential and not isinstance(m, phalanx.Stack)
        assert torch.equal(m(x), members[i](x))
        assert_close(m(x), out[i])
    assert [type(m) for m in stack[1:3]] == [nn.Sequential] * 2
    assert len(list(stack)) == N
    assert torch.equal(stack[1:3][1][0].weight, members[2][0].weight)


def test_stack_i_out_of_range_or_of_a_wrong_type_names_the_range():
    stack = _stack()
    with pytest.raises(
        IndexError, match=r"Stack\[i\]: member index 4 .* 4 members \(valid: -4 \.\. 3\)"
    ):
        stack[N]
    with pytest.raises(IndexError, match="member index -5"):
        stack[-N - 1]
    with pytest.raises(TypeError, match=r"int or a slice, not str"):
        stack["0"]  # type: ignore[call-overload]


def test_stack_i_is_a_copy_writing_it_leaves_the_stack_and_stack_i_assign_writes_back():
    stack = _stack()
    before = stack.module[0].weight.detach().clone()
    m = stack[2]
    with torch.no_grad():
        m[0].weight.add_(1.0)  # writing into the copy ...
    assert torch.equal(stack.module[0].weight, before)  # ... leaves the stack
    opt = torch.optim.SGD(stack.parameters(), lr=0.1)
    phalanx.member_losses(
        F.cross_entropy, stack(torch.randn(B, 4)), torch.zeros(B).long()
    ).sum().backward()
    opt.step()
    assert torch.equal(m[0].weight, before[2] + 1.0)  # training the stack leaves the copy
    stack[2] = m  # writing back: the same stacked tensor objects, member 2's rows
    assert torch.equal(stack.module[0].weight[2], m[0].weight)
    assert stack.module[0].weight is next(iter(stack.parameters()))
    with pytest.raises(ValueError, match=r"(?s)Stack\[i\] = module.*shape"):
        stack[0] = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 3))


def test_stack_i_of_a_padded_stack_has_its_own_widths():
    def net(h: int) -> nn.Module:
        return nn.Sequential(nn.Linear(4, h), nn.ReLU(), nn.Linear(h, 3))

    stack = phalanx.stack([net(3), net(5)], pad_widths=True)
    assert stack[0][0].weight.shape == (3, 4) and stack[-1][0].weight.shape == (5, 4)
    x = torch.randn(2, 4)
    assert_close(stack[1](x), stack(x)[1])


def test_a_stack_is_annotated_with_what_its_call_returns():
    # for type checkers stack(x) is a Tensor by default; Stack[T] names another output type
    # (mypy on `out = stack(x)` reveals torch.Tensor: checked by hand)
    stack: phalanx.Stack[dict] = phalanx.stack([nn.Linear(4, 3) for _ in range(2)])
    assert phalanx.Stack[dict].__origin__ is phalanx.Stack
    assert isinstance(stack, phalanx.Stack)
