"""A per-member label_smoothing in member_losses: each member's loss and gradient its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import phalanx
from helpers import assert_close

N, B, C = 4, 6, 5
EPS = [0.0, 0.05, 0.1, 0.3]


def _reference(out, target, per_member_target, **kwargs):
    losses = []
    for i in range(N):
        t = target[i] if per_member_target else target
        losses.append(F.cross_entropy(out[i], t, label_smoothing=EPS[i], **kwargs))
    return torch.stack(losses)


@pytest.mark.parametrize("form", ["tensor", "list"])
@pytest.mark.parametrize(
    "case", ["shared", "per_member", "probabilities", "ignore_index_and_weight"]
)
def test_per_member_label_smoothing_equals_each_members_own_loss(case, form):
    torch.manual_seed(0)
    out = torch.randn(N, B, C, requires_grad=True)
    kwargs = {}
    in_dims = (0, None)
    if case == "per_member":
        target, in_dims = torch.randint(0, C, (N, B)), (0, 0)
    elif case == "probabilities":
        target = torch.randn(B, C).softmax(-1)
    else:
        target = torch.randint(0, C, (B,))
    if case == "ignore_index_and_weight":
        target[1] = -100
        kwargs["weight"] = torch.rand(C) + 0.5
    smoothing = torch.tensor(EPS) if form == "tensor" else EPS
    losses = phalanx.member_losses(
        F.cross_entropy, out, target, in_dims=in_dims, label_smoothing=smoothing, **kwargs
    )
    expected = _reference(out, target, case == "per_member", **kwargs)
    assert_close(losses, expected, msg="losses")
    grad = torch.autograd.grad(losses.sum(), out)[0]
    ref_grad = torch.autograd.grad(expected.sum(), out)[0]
    assert_close(grad, ref_grad, msg="gradients")


def test_per_member_label_smoothing_errors_name_the_problem():
    out, y = torch.randn(N, B, C), torch.randint(0, C, (B,))
    with pytest.raises(ValueError, match=r"one per member: shape \(4,\); got shape \(3,\)"):
        phalanx.member_losses(F.cross_entropy, out, y, label_smoothing=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        phalanx.member_losses(F.cross_entropy, out, y, label_smoothing=[0.1, 0.2, 0.3, 1.5])
    with pytest.raises(
        ValueError, match=r"supported for loss_fn=torch\.nn\.functional\.cross_entropy"
    ):
        phalanx.member_losses(F.nll_loss, out, y, label_smoothing=EPS)


@pytest.mark.parametrize(
    ("loss_fn", "smoothing"),
    [(F.cross_entropy, 0.1), (F.cross_entropy, EPS), (F.cross_entropy, 0.0), (F.nll_loss, None)],
)
def test_class_weights_with_per_member_targets_equal_each_members_own_loss(loss_fn, smoothing):
    # weight= with label_smoothing and (N, B) targets raised torch's raw "vmap: Attempted to
    # vmap over `mask` in torch.masked_select"
    kwargs = {} if smoothing is None else {"label_smoothing": smoothing}
    torch.manual_seed(0)
    out = torch.randn(N, B, C, requires_grad=True)
    target = torch.randint(0, C, (N, B))
    target[2, 1] = -100  # ignored: counts in neither the sum nor the weights' sum
    weight = torch.rand(C) + 0.5

    def loop(o, w, member):
        eps = {"label_smoothing": smoothing[member]} if isinstance(smoothing, list) else kwargs
        return loss_fn(o[member], target[member], weight=w, **eps)

    losses = phalanx.member_losses(loss_fn, out, target, in_dims=(0, 0), weight=weight, **kwargs)
    grad = torch.autograd.grad(losses.sum(), out)[0]
    out64 = out.detach().double().requires_grad_()
    for i in range(N):
        own = loop(out, weight, i)
        own64 = loop(out64, weight.double(), i)
        phalanx.testing.assert_equal_to_loop(losses[i], own, own64, what=f"member {i} loss")
        g, g64 = (torch.autograd.grad(v, o)[0][i] for v, o in ((own, out), (own64, out64)))
        phalanx.testing.assert_equal_to_loop(grad[i], g, g64, what=f"member {i} gradient")
