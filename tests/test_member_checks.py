"""What a member sees and raises under the vmap backends is what it sees and raises alone.

Issue 29's classes 1, 2, 7a, 9 and 10a: per-member checks an op makes on its inputs (ids,
offsets, classes), the layout of what a rule hands back, outputs holding None, an exported
program that raises, a kept member's BatchNorm bits, and a member's own error re-raised as
the loop raises it. Every case is compared with the members run alone (the loop).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.backends import BackendRefusal

BACKENDS = ["fused", "vmap", "auto", "loop"]


def _stack(members: list[nn.Module], backend: str) -> phalanx.Stack:
    return phalanx.stack(copy.deepcopy(members), backend=backend)


def _alone(members: list[nn.Module], x: torch.Tensor, per_member: bool) -> BaseException | None:
    """The first error a member raises alone, or None."""
    for i, m in enumerate(copy.deepcopy(members)):
        try:
            m(x[i] if per_member else x)
        except Exception as e:
            return e
    return None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0]


# --------------------------------------------------- a member's own error, as the loop raises it


class LinearBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.enc(x))


@pytest.mark.parametrize("backend", ["fused", "vmap"])
@pytest.mark.parametrize(
    "case, x, per_member, submodule",
    [
        ("batch of one in training", torch.randn(3, 1, 3), True, "'bn'"),
        ("wrong feature size, per-member input", torch.randn(3, 5, 6), True, "'enc.0'"),
        ("wrong feature size, shared input", torch.randn(5, 6), False, "'enc.0'"),
        ("dtype", torch.randn(5, 3, dtype=torch.float64), False, "'enc.0'"),
    ],
)
def test_a_members_own_error_is_raised_as_the_loop_raises_it(
    backend, case, x, per_member, submodule
):
    torch.manual_seed(0)
    members = [LinearBN() for _ in range(3)]
    expected = _alone(members, x, per_member)
    assert expected is not None, case
    stack = _stack(members, backend)
    before = [t.detach().clone() for t in stack.parameters()]
    with pytest.raises(type(expected)) as got:
        stack(x, in_dims=0 if per_member else None)
    assert not isinstance(got.value, BackendRefusal)
    assert _first_line(got.value) == _first_line(expected)
    note = " ".join(getattr(got.value, "__notes__", []))
    assert "member 0's own forward" in note and submodule in note, note
    assert "bmm" not in str(got.value)
    # Finding the member's error (running the members alone on copies) wrote no parameter.
    # (What the vmapped call wrote before it failed, BatchNorm's num_batches_tracked, stays
    # written, for every member: the loop leaves it written for the members before the one
    # that raised.)
    for b, t in zip(before, stack.parameters()):
        assert torch.equal(b, t.detach())


def test_what_torch_func_cannot_batch_is_still_a_refusal():
    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return h if h.sum() > 0 else -h

    stack = phalanx.stack([Branch() for _ in range(2)], backend="fused")
    with pytest.raises(BackendRefusal, match="turns its data into a Python value"):
        stack(torch.randn(4, 3))


class GRUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 4, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x)[0]


@pytest.mark.parametrize("backend", ["fused", "auto", "loop"])
def test_forward_mode_ad_through_a_gru_equals_the_members(backend):
    torch.manual_seed(0)
    members = [GRUNet() for _ in range(3)]
    x, t = torch.randn(3, 2, 5, 3), torch.randn(3, 2, 5, 3)
    stack = _stack(members, backend)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(stack(fwAD.make_dual(x, t), in_dims=0)).tangent
    _, jvp = torch.func.jvp(lambda x: stack(x, in_dims=0), (x,), (t,))
    assert stack.backend == ("fused" if backend == "auto" else backend)  # auto kept fused
    for i, m in enumerate(members):
        _, own = torch.func.jvp(m, (x[i],), (t[i],))
        torch.testing.assert_close(tangent[i], own)
        torch.testing.assert_close(jvp[i], own)


@pytest.mark.parametrize(
    "variant",
    [{"kdim": 6, "vdim": 5}, {"add_bias_kv": True}, {"add_zero_attn": True}, {}],
    ids=["kdim-vdim", "bias-kv", "zero-attn", "plain"],
)
@pytest.mark.parametrize("masks", [None, "padding", "both"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_variants_run_on_fused(variant, masks, need_weights):
    """Issue 29, 10a: kdim / vdim, bias_k / bias_v and add_zero_attn run on fused (auto kept
    it), each member as alone, masks included."""

    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True, **variant)

        def forward(self, q, k, v, padding, mask):
            return self.attn(
                q, k, v, key_padding_mask=padding, attn_mask=mask, need_weights=need_weights
            )

    torch.manual_seed(0)
    members = [Attend() for _ in range(3)]
    q = torch.randn(3, 2, 4, 8)
    k = torch.randn(3, 2, 7, variant.get("kdim", 8))
    v = torch.randn(3, 2, 7, variant.get("vdim", 8))
    padding = torch.rand(3, 2, 7) < 0.3 if masks else None
    if padding is not None:
        padding[..., 0] = False  # no sample with every key masked
    mask = torch.rand(3, 4, 7) < 0.3 if masks == "both" else None  # each member's (T, S)
    if mask is not None:
        mask[..., 0] = False
    args = (q, k, v, padding, mask)
    dims = tuple(None if a is None else 0 for a in args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto must not hand over to the loop
        for backend in ("fused", "auto"):
            stack = _stack(members, backend)
            out, weights = stack(*args, in_dims=dims)
            assert stack.backend == "fused"
            out.square().sum().backward()
            alone = copy.deepcopy(members)
            for i, m in enumerate(alone):
                own, own_w = m(*(None if a is None else a[i] for a in args))
                torch.testing.assert_close(out[i], own)
                assert out[i].stride() == own.stride()
                assert (weights is None) == (own_w is None)
                if own_w is not None:
                    torch.testing.assert_close(weights[i], own_w)
                own.square().sum().backward()
            for name, p in stack.module.named_parameters():
                own_grads = torch.stack([dict(m.named_parameters())[name].grad for m in alone])
                torch.testing.assert_close(p.grad, own_grads, msg=name)


# ------------------------------------------------------------------------- outputs holding None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ["none", "tuple", "dict", "nested"])
def test_outputs_holding_none_are_returned_as_the_loop_returns_them(backend, shape):
    class Out(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            y = self.fc(x)
            if shape == "none":
                return None
            if shape == "tuple":
                return y, None
            if shape == "dict":
                return {"logits": y, "aux_loss": None}
            return [None, (y, {"a": None, "b": y * 2}), 7]

    torch.manual_seed(0)
    members = [Out() for _ in range(3)]
    x = torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto must not hand over to the loop
        got = _stack(members, backend)(x)
    want = _stack(members, "loop")(x)
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    want_leaves, want_spec = torch.utils._pytree.tree_flatten(want)
    assert got_spec == want_spec
    for a, b in zip(got_leaves, want_leaves):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b)
        else:
            assert a == b


# -------------------------------------------------------------- an exported program that raises


def test_an_exported_program_that_raises_leaves_no_vmap_level_behind():
    class EmbNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 3)

        def forward(self, ids):
            return self.out(self.emb(ids).mean(1))

    torch.manual_seed(0)
    stack = phalanx.stack([EmbNet() for _ in range(3)]).eval()
    ids = torch.randint(0, 10, (3, 4, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served = phalanx.export(stack, (ids,), {"in_dims": 0}).module()
    torch.testing.assert_close(served(ids, in_dims=0), stack(ids, in_dims=0))
    for member, bad in ((0, 10), (2, -1)):
        ids_bad = ids.clone()
        ids_bad[member, 1, 2] = bad
        with pytest.raises(RuntimeError, match="index out of range"):
            served(ids_bad, in_dims=0)
        assert torch._C._functorch.maybe_current_level() is None
    assert not torch._C._functorch.is_batchedtensor(F.dropout(torch.ones(3), 0.5))
    nn.Linear(3, 3)  # raised "Cannot ask for different inplace randomness" inside a level
    torch.testing.assert_close(served(ids, in_dims=0), stack(ids, in_dims=0))


# ------------------------------------------------------- a kept member's BatchNorm bits, any N


def _bn_1d() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.BatchNorm1d(7), nn.Linear(7, 3))


def _bn_2d() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 5, 3), nn.BatchNorm2d(5), nn.ReLU(), nn.Flatten(), nn.Linear(80, 3)
    )


def _bn_3d_length_one() -> nn.Module:
    return nn.Sequential(nn.Conv1d(2, 9, 3), nn.BatchNorm1d(9), nn.Flatten(), nn.Linear(9, 2))


@pytest.mark.parametrize("backend", ["fused", "vmap"])
@pytest.mark.parametrize(
    "make, shape",
    [(_bn_1d, (6, 5)), (_bn_2d, (6, 2, 6, 6)), (_bn_3d_length_one, (6, 2, 3))],
    ids=["1d", "2d", "length-one"],
)
@pytest.mark.parametrize("train", [True, False])
def test_a_kept_members_batchnorm_bits_do_not_depend_on_n(backend, make, shape, train):
    torch.manual_seed(0)
    members = [make().train(train) for _ in range(7)]
    x = torch.randn(7, *shape)
    seen = {}
    for keep in (list(range(7)), [0, 3], [3], [3, 4, 5], [1, 2, 3, 4, 5, 6]):
        stack = phalanx.stack([copy.deepcopy(members[i]) for i in keep], backend=backend)
        for _ in range(2):  # the second call reads the running statistics the first wrote
            out = stack(x[keep], in_dims=0)
        out.square().sum().backward()
        k = keep.index(3)
        seen[tuple(keep)] = [
            out[k].detach(),
            *(p.grad[k] for p in stack.parameters()),
            *(b[k] for b in stack.buffers()),
        ]
    full = seen[tuple(range(7))]
    for keep, got in seen.items():
        assert len(got) == len(full)
        for i, (a, b) in enumerate(zip(got, full)):
            assert torch.equal(a, b), f"member 3 kept as {keep}: tensor {i} differs"


@pytest.mark.parametrize("backend", ["fused", "vmap"])
@pytest.mark.parametrize("padding_idx", [-1, 2, 5, -6])
def test_functional_embedding_padding_idx_as_alone(backend, padding_idx):
    """F.embedding's own checks and its negative padding_idx, per member."""

    class Emb(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(5, 3))

        def forward(self, ids):
            return F.embedding(ids, self.weight, padding_idx=padding_idx)

    torch.manual_seed(0)
    members = [Emb() for _ in range(3)]
    ids = torch.tensor([[0, 4, 2, 4], [1, 2, 3, 4]])
    stack = _stack(members, backend)
    expected = _alone(members, ids, per_member=False)
    if expected is not None:
        with pytest.raises(type(expected), match="Padding_idx must be within num_embeddings"):
            stack(ids)
        return
    stack(ids).square().sum().backward()
    for i, m in enumerate(copy.deepcopy(members)):
        m(ids).square().sum().backward()
        torch.testing.assert_close(stack.module.weight.grad[i], m.weight.grad)


class Warp(nn.Module):
    """A spatial-transformer block on a convolution's feature map (repro_grid_sample_layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.theta = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        theta = self.theta(h.mean((-1, -2))).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(h.shape), align_corners=False)
        out = F.grid_sample(h, grid, align_corners=False)
        assert h.is_contiguous() and out.is_contiguous()  # as alone
        return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", [2, 3])  # 3 = N: a misplaced member axis looks right
@pytest.mark.parametrize("shared", [True, False])
def test_grid_sample_after_a_shared_input_convolution_is_each_members(backend, batch, shared):
    torch.manual_seed(0)
    members = [Warp() for _ in range(3)]
    x = torch.randn(batch, 1, 6, 6) if shared else torch.randn(3, batch, 1, 6, 6)
    stack = _stack(members, backend)
    out = stack(x, in_dims=None if shared else 0)
    out.square().sum().backward()
    for i, m in enumerate(copy.deepcopy(members)):
        own = m(x if shared else x[i])
        torch.testing.assert_close(out[i], own)
        own.square().sum().backward()
        torch.testing.assert_close(stack.module.theta.weight.grad[i], m.theta.weight.grad)
        torch.testing.assert_close(stack.module.conv.weight.grad[i], m.conv.weight.grad)
