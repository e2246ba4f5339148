"""The fused backend: every batched layer against the loop of independent copies; a forward
that works across its batch is per member by construction, and what cannot be batched is
refused where it happens."""

from __future__ import annotations

import copy
import itertools
import re

import pytest
import torch
from torch import nn

import phalanx
from helpers import Arch, assert_close, check_forward_and_gradients, reference_outputs
from phalanx.backends import BackendRefusal, _fused
from phalanx_tools.threads import intra_op_threads


class Wrap(nn.Module):
    """A custom module whose forward only composes known layers and elementwise ops."""

    def __init__(self, layers: nn.ModuleDict) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x * 0.5 + torch.sigmoid(x)


class BilinearNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bilinear = nn.Bilinear(4, 3, 5)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.bilinear(x, z)


class EmbeddingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4, padding_idx=0)
        self.head = nn.Linear(4, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx).mean(-2))


def _seq(*layers: nn.Module) -> nn.Module:
    return nn.Sequential(*layers)


def _random_slopes(module: nn.Module) -> nn.Module:
    """PReLU starts every member at 0.25; different slopes show if members were mixed."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.PReLU):
                m.weight.uniform_(0.05, 0.5)
    return module


def _random_affine(module: nn.Module) -> nn.Module:
    """GroupNorm starts every member at weight 1, bias 0; different ones show if members'
    channels were mixed."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
    return module


LAYERS = [
    Arch("linear_no_bias", lambda: _seq(nn.Linear(6, 5, bias=False), nn.Tanh()),
         lambda b: (torch.randn(b, 6),)),
    Arch("linear_3d_input", lambda: _seq(nn.Linear(6, 5), nn.SiLU(), nn.Linear(5, 2)),
         lambda b: (torch.randn(b, 3, 6),)),
    Arch("bilinear", BilinearNet, lambda b: (torch.randn(b, 4), torch.randn(b, 3))),
    Arch("conv1d_bn1d_pool", lambda: _seq(
        nn.Conv1d(3, 4, 3, padding=1, bias=False), nn.BatchNorm1d(4), nn.LeakyReLU(0.1),
        nn.AvgPool1d(2), nn.Flatten(), nn.Linear(12, 2)), lambda b: (torch.randn(b, 3, 6),)),
    Arch("conv2d_groups_reflect_stride", lambda: _seq(
        nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, padding_mode="reflect"),
        nn.ELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(1)), lambda b: (torch.randn(b, 4, 7, 7),)),
    Arch("conv2d_dilation_maxpool", lambda: _seq(
        nn.Conv2d(2, 3, 3, dilation=2), nn.GroupNorm(3, 3), nn.ReLU6(), nn.MaxPool2d(2)),
        lambda b: (torch.randn(b, 2, 9, 9),)),
    Arch("conv_transpose", lambda: _seq(
        nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1), nn.Hardswish(),
        nn.Conv2d(2, 2, 1), nn.Flatten(), nn.Unflatten(1, (2, 8, 8))),
        lambda b: (torch.randn(b, 3, 4, 4),)),
    Arch("conv_transpose1d", lambda: _seq(nn.ConvTranspose1d(2, 3, 4, stride=2), nn.Mish()),
         lambda b: (torch.randn(b, 2, 5),)),
    Arch("batchnorm1d_on_features", lambda: _seq(
        nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Softplus(), nn.Linear(6, 3), nn.LogSoftmax(dim=1)),
        lambda b: (torch.randn(b, 5),)),
    Arch("layernorm_groupnorm", lambda: _seq(
        nn.Linear(5, 8), nn.LayerNorm(8), nn.GELU(), nn.Unflatten(1, (4, 2)), nn.GroupNorm(2, 4),
        nn.Flatten(), nn.Softmax(dim=-1)), lambda b: (torch.randn(b, 5),)),
    Arch("embedding_padding_idx", EmbeddingNet,
         lambda b: (torch.randint(0, 11, (b, 6)),)),
    Arch("custom_container", lambda: Wrap(nn.ModuleDict(
        {"a": nn.Linear(4, 6), "b": nn.Identity(), "c": nn.Hardtanh(), "d": nn.Linear(6, 2)})),
        lambda b: (torch.randn(b, 4),)),
    Arch("conv3d", lambda: _seq(nn.Conv3d(1, 2, 2), nn.BatchNorm3d(2), nn.Sigmoid()),
         lambda b: (torch.randn(b, 1, 3, 3, 3),)),
    Arch("prelu_per_channel_and_shared", lambda: _random_slopes(_seq(
        nn.Conv1d(2, 3, 2), nn.PReLU(3), nn.Flatten(), nn.Linear(9, 4), nn.PReLU())),
        lambda b: (torch.randn(b, 2, 4),)),
    Arch("conv2d_groupnorm_two_channels_a_group", lambda: _random_affine(_seq(
        nn.Conv2d(3, 8, 3), nn.GroupNorm(4, 8), nn.SiLU())),
        lambda b: (torch.randn(b, 3, 6, 5),)),
]  # fmt: skip

CASES = [
    pytest.param(backend, arch, mode, n, id=f"{backend}-{arch.name}-{mode}-N{n}")
    for backend, arch, mode, n in itertools.product(
        ["fused", "auto"], LAYERS, ["shared", "per_member"], [1, 3]
    )
]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("backend", "arch", "mode", "n"), CASES)
def test_every_batched_layer_matches_loop(backend, arch, mode, n, train):
    check_forward_and_gradients(backend, arch, mode, n, train)


def test_auto_picks_fused_where_it_is_exact_and_far_faster():
    # 256 tiny members: the loop makes 256 calls per layer, fused one, so the race auto runs
    # on its first call must pick fused. One thread: on a loaded 2-core machine two OpenMP
    # threads can slow a batched kernel down by 50x, which is noise this test is not about.
    with intra_op_threads(1):
        stack = phalanx.stack([MLPS[0].make() for _ in range(256)])
        assert stack.backend == "fused"
        stack(torch.randn(8, 5))
        assert stack.backend == "fused"


@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_convolutions_run_per_member_exactly(mode):
    # One grouped convolution over N * C channels (torch.func's rule) rounds weight gradients
    # far from the loop; phalanx runs one convolution per member, as the loop does.
    arch = Arch("conv", lambda: _seq(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                     nn.Conv2d(4, 4, 3, groups=2)), lambda b: (torch.randn(b, 2, 8, 8),))  # fmt: skip
    check_forward_and_gradients("fused", arch, mode, 3, True)
    check_forward_and_gradients("vmap", arch, mode, 3, True)


@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_small_filters_of_a_shared_input_run_per_member_exactly(mode):
    # one input channel, 3x3: 9 products per output, below SIDE_BY_SIDE_MIN_TAPS, so a shared
    # input runs one convolution per member (the side-by-side one above it); both exact
    arch = Arch("conv1", lambda: _seq(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                      nn.Conv2d(4, 2, 2)), lambda b: (torch.randn(b, 1, 8, 8),))  # fmt: skip
    check_forward_and_gradients("fused", arch, mode, 3, True)
    check_forward_and_gradients("fused", arch, mode, 3, False)
    arch1d = Arch("conv1d", lambda: _seq(nn.Conv1d(2, 3, 3), nn.ReLU(), nn.Conv1d(3, 2, 5)),
                  lambda b: (torch.randn(b, 2, 12),))  # fmt: skip
    check_forward_and_gradients("fused", arch1d, mode, 3, True)


# ------------------------------------------------- what a forward does across its batch


class MixesBatch(nn.Module):
    """Subtracts the batch mean: each member's own, by construction under vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h - h.mean(0)


class ReshapesBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).reshape(x.shape[0], -1)


class BranchesOnValues(nn.Module):
    """Decides on a member's data in Python: only the loop can run it member by member."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h if h.sum() > 0 else -h


def test_a_forward_mixing_its_batch_runs_fused_exactly():
    arch = Arch("mixes", MixesBatch, lambda b: (torch.randn(b, 4),))
    for mode in ("shared", "per_member"):
        check_forward_and_gradients("fused", arch, mode, 3, True)
        check_forward_and_gradients("auto", arch, mode, 3, True)


def test_auto_falls_back_with_a_warning_and_the_right_answer():
    torch.manual_seed(0)
    members = [BranchesOnValues() for _ in range(3)]
    x = torch.randn(5, 4)
    expected = reference_outputs(members, (x,), (None,))
    stack = phalanx.stack(copy.deepcopy(members))
    with pytest.warns(UserWarning, match=r"backend 'fused' cannot run this model exactly"):
        out = stack(x)
    assert stack.backend == "loop"
    assert_close(out, expected)


def test_a_reshape_by_the_batch_size_runs_fused_exactly():
    # Per-sample code reads the batch size from x.shape[0]: on the folded batch it is N * B,
    # so the reshape keeps each sample's rows together, as in the member alone.
    arch = Arch("reshapes", ReshapesBatch, lambda b: (torch.randn(b, 4),))
    check_forward_and_gradients("fused", arch, "shared", 3, True)
    check_forward_and_gradients("fused", arch, "per_member", 3, True)


def test_explicit_fused_refuses_what_it_cannot_honour():
    stack = phalanx.stack([BranchesOnValues() for _ in range(3)], backend="fused")
    with pytest.raises(
        RuntimeError,
        match=r"backend 'fused' cannot run this architecture under torch.func.vmap: the "
        r"member's forward turns its data into a Python value",
    ):
        stack(torch.randn(5, 4))


class OwnParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def test_a_module_holding_its_own_parameters_runs_fused_exactly():
    # A custom module with a raw nn.Parameter (mbrl-lib's and EDAC's ensemble layers, nanoGPT's
    # LayerNorm) runs per member under vmap inside the fused forward.
    arch = Arch("own_parameter", OwnParameter, lambda b: (torch.randn(b, 3),))
    check_forward_and_gradients("fused", arch, "shared", 3, True)
    check_forward_and_gradients("fused", arch, "per_member", 3, True)


def test_fused_updates_buffers_once_and_draws_no_extra_random_numbers():
    torch.manual_seed(0)
    arch = LAYERS[3]  # Conv1d + BatchNorm1d
    members = [arch.make() for _ in range(3)]
    reference = copy.deepcopy(members)
    x = arch.inputs(4)[0]
    stack = phalanx.stack(members, backend="fused")
    torch.manual_seed(5)
    stack(x)
    after_stack = torch.rand(1)
    torch.manual_seed(5)
    for m in reference:
        m(x)
    after_loop = torch.rand(1)
    assert torch.equal(after_stack, after_loop), "fused consumed random numbers"
    for i, m in enumerate(reference):
        assert_close(stack.module[1].running_mean[i], m[1].running_mean)
        assert int(stack.module[1].num_batches_tracked[i]) == 1


def test_fused_dropout_masks_differ_per_member():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 64), nn.Dropout(0.5))
    stack = phalanx.stack([copy.deepcopy(base) for _ in range(4)], backend="fused")
    x = torch.randn(16, 6)
    out = stack(x)
    h = base[0](x)
    kept = out != 0
    assert not torch.equal(kept[0], kept[1])
    torch.testing.assert_close(out[kept], (h * 2).expand(4, -1, -1)[kept])


def test_torch_compile_gives_the_same_results():
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)) for _ in range(4)]
    stack = phalanx.stack(members, backend="fused")
    x = torch.randn(8, 10)
    eager = stack(x)
    compiled = torch.compile(stack, backend="eager")  # the inductor needs a C++ toolchain
    torch.testing.assert_close(compiled(x), eager)
    xs = torch.randn(4, 8, 10)
    torch.testing.assert_close(compiled(xs, in_dims=0), stack(xs, in_dims=0))


# ------------------------------------------------------------------------- the MLP fast path

MLPS = [
    Arch("mlp_relu", lambda: _seq(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)),
         lambda b: (torch.randn(b, 5),)),
    Arch("mlp_tanh_sigmoid_no_bias", lambda: _seq(
        nn.Linear(5, 7, bias=False), nn.Tanh(), nn.Linear(7, 6), nn.Sigmoid(), nn.Linear(6, 2)),
        lambda b: (torch.randn(b, 5),)),
    Arch("mlp_leaky_identity_3d", lambda: _seq(
        nn.Tanh(), nn.Linear(4, 6), nn.LeakyReLU(0.2), nn.Identity(), nn.Linear(6, 6), nn.ReLU()),
        lambda b: (torch.randn(b, 3, 4),)),
    Arch("linear_chain_no_activation", lambda: _seq(nn.Linear(20, 10), nn.Linear(10, 1)),
         lambda b: (torch.randn(b, 20),)),
]  # fmt: skip


@pytest.mark.parametrize("mode", ["shared", "per_member"])
@pytest.mark.parametrize("arch", MLPS, ids=[a.name for a in MLPS])
def test_mlp_fast_path_matches_loop(arch, mode, monkeypatch):
    taken = []

    def spy(*args, **kwargs):
        out = run_mlp(*args, **kwargs)
        taken.append(out is not None)
        return out

    run_mlp = _fused.run_mlp
    monkeypatch.setattr(_fused, "run_mlp", spy)
    check_forward_and_gradients("fused", arch, mode, 3, True)
    assert taken and all(taken), "the fast path must be the one under test"


def test_mlp_fast_path_sees_hooks_and_settings_changed_after_the_first_call():
    torch.manual_seed(0)
    members = [_seq(nn.Linear(5, 7), nn.LeakyReLU(0.1), nn.Linear(7, 3)) for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    x = torch.randn(4, 5)
    stack(x)
    for m in [stack.module, *members]:
        m[1].negative_slope = 0.3
    assert_close(stack(x), reference_outputs(members, (x,), (None,)))
    stack.module[2].register_forward_hook(lambda mod, i, out: out * 2)
    with pytest.raises(BackendRefusal, match=r"hooks on '2', which must run once per member"):
        stack(x)  # not the fast path's answer without the hook


def test_mlp_fast_path_respects_frozen_parameters():
    torch.manual_seed(0)
    members = [MLPS[0].make() for _ in range(3)]
    for m in members:
        m[0].weight.requires_grad_(False)
    reference = copy.deepcopy(members)
    stack = phalanx.stack(members, backend="fused")
    x = torch.randn(4, 5)
    stack(x).square().sum().backward()
    for m in reference:
        m(x).square().sum().backward()
    assert stack.module[0].weight.grad is None
    for i, m in enumerate(reference):
        assert_close(stack.module[2].weight.grad[i], m[2].weight.grad)
        assert_close(stack.module[0].bias.grad[i], m[0].bias.grad)


def test_mlp_no_grad_forward_in_member_chunks(monkeypatch):
    from phalanx.backends import _fused_mlp

    monkeypatch.setattr(_fused_mlp, "_CHUNK_BYTES", 4 * 4 * 7 * 2)  # two members a chunk
    torch.manual_seed(0)
    members = [MLPS[0].make() for _ in range(5)]
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    for args, dims in [((torch.randn(4, 5),), (None,)), ((torch.randn(5, 4, 5),), (0,))]:
        with torch.no_grad():
            out = stack(*args, in_dims=dims)
        assert_close(out, reference_outputs(members, args, dims))


def test_a_diverged_member_leaves_the_others_alone():
    torch.manual_seed(0)
    members = [MLPS[0].make() for _ in range(3)]
    with torch.no_grad():
        members[1][0].weight.fill_(float("nan"))
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    for batch in (4, 5):
        x = torch.randn(batch, 5)
        out = stack(x)
        assert torch.isnan(out[1]).all()
        assert_close(out[[0, 2]], reference_outputs(members, (x,), (None,))[[0, 2]])


@pytest.mark.parametrize(
    "backend",
    [
        "loop",
        "fused",
        "auto",
        pytest.param(
            "vmap",
            marks=pytest.mark.xfail(
                strict=True,
                raises=RuntimeError,
                reason="under CPU autocast torch.func.vmap runs the member in float32, not the "
                "loop's bfloat16: backend 'vmap' refuses (auto hands over)",
            ),
        ),
    ],
)
@pytest.mark.parametrize("arch", [MLPS[0], LAYERS[3]], ids=["mlp", "conv1d_bn1d"])
def test_autocast_matches_the_loop_under_autocast(backend, arch):
    torch.manual_seed(0)
    members = [arch.make().eval() for _ in range(3)]
    x = arch.inputs(4)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference_outputs(members, (x,), (None,))
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = stack(x)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()  # the backward pass runs under mixed dtypes
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in stack.parameters())


@pytest.mark.parametrize("bias", [True, False])
def test_batched_linear_is_twice_differentiable_and_grads_keep_the_weight_layout(bias):
    from phalanx.backends._bmm import linear_bmm

    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 2, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = (x, w, b) if bias else (x, w)
    fn = (lambda x, w, b: linear_bmm(x, w, b)) if bias else (lambda x, w: linear_bmm(x, w, None))
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)
    (gw,) = torch.autograd.grad(linear_bmm(x, w, b).sum(), w)
    assert gw.stride() == w.stride(), "laid out unlike the weight: AccumulateGrad would copy it"


# ------------------------------------------------------------------------------ attention


class Encoder(nn.Module):
    """A TransformerEncoderLayer with the masks real text models pass."""

    def __init__(self, masks: str, batch_first: bool = True) -> None:
        super().__init__()
        self.masks, self.batch_first = masks, batch_first
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        kwargs: dict = {}
        if "padding" in self.masks:
            kwargs["src_key_padding_mask"] = pad
        if "causal" in self.masks:
            kwargs["src_mask"] = nn.Transformer.generate_square_subsequent_mask(t)
            kwargs["is_causal"] = True
        if not self.batch_first:
            return self.layer(x.transpose(0, 1), **kwargs).transpose(0, 1)
        return self.layer(x, **kwargs)


class Attention(nn.Module):
    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.need_weights = need_weights
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, bias=True)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        out, w = self.attn(x, x, x, key_padding_mask=pad, need_weights=self.need_weights)
        return out if w is None else out + w.sum(-1, keepdim=True)


def _padding(b: int) -> torch.Tensor:
    pad = torch.zeros(b, 5, dtype=torch.bool)
    pad[::2, 3:] = True  # every other sample is shorter
    return pad


ATTENTION = [
    Arch("encoder_plain", lambda: Encoder(""), lambda b: (torch.randn(b, 5, 8), _padding(b))),
    Arch("encoder_padding", lambda: Encoder("padding"), lambda b: (torch.randn(b, 5, 8), _padding(b))),
    Arch("encoder_causal_seq_first", lambda: Encoder("causal", batch_first=False),
         lambda b: (torch.randn(b, 5, 8), _padding(b))),
    Arch("encoder_padding_causal", lambda: Encoder("padding causal"),
         lambda b: (torch.randn(b, 5, 8), _padding(b))),
    Arch("mha_with_weights", lambda: Attention(True), lambda b: (torch.randn(b, 5, 8), _padding(b))),
    Arch("mha_no_weights", lambda: Attention(False), lambda b: (torch.randn(b, 5, 8), _padding(b))),
]  # fmt: skip


@pytest.mark.parametrize("mode", ["shared", "per_member"])
@pytest.mark.parametrize("arch", ATTENTION, ids=[a.name for a in ATTENTION])
@pytest.mark.filterwarnings("ignore:Support for mismatched src_key_padding_mask")
def test_attention_matches_the_loop(arch, mode):
    check_forward_and_gradients("fused", arch, mode, 3, True)


class Bags(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(13, 4, **kw)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(ids))


class OffsetBags(nn.Module):
    """The text classification tutorial's call: flat ids with bag offsets."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(13, 4, mode=mode)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.bag(ids, offsets)


BAGS = [
    Arch("bag_mean", lambda: Bags(), lambda b: (torch.randint(0, 13, (b, 5)),)),
    Arch("bag_sum_scaled", lambda: Bags(mode="sum", scale_grad_by_freq=True),
         lambda b: (torch.randint(0, 13, (b, 5)),)),
    Arch("bag_max_padding", lambda: Bags(mode="max", padding_idx=0),
         lambda b: (torch.randint(0, 13, (b, 5)),)),
    Arch("bag_offsets", lambda: OffsetBags("mean"),
         lambda b: (torch.randint(0, 13, (3 * b,)), torch.arange(b) * 3)),
]  # fmt: skip


@pytest.mark.parametrize("mode", ["shared", "per_member"])
@pytest.mark.parametrize("arch", BAGS, ids=[a.name for a in BAGS])
def test_embedding_bags_match_the_loop(arch, mode):
    check_forward_and_gradients("fused", arch, mode, 3, True)


class Lookups(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 4, **kw)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).sum(1)


LOOKUPS = [
    Arch("embedding_scaled", lambda: Lookups(scale_grad_by_freq=True),
         lambda b: (torch.randint(0, 13, (b, 5)),)),
]  # fmt: skip


@pytest.mark.parametrize("mode", ["shared", "per_member"])
@pytest.mark.parametrize("arch", LOOKUPS, ids=[a.name for a in LOOKUPS])
def test_embedding_options_match_the_loop(arch, mode):
    check_forward_and_gradients("fused", arch, mode, 3, True)


@pytest.mark.parametrize("per_member", [False, True])
def test_embedding_max_norm_renormalises_each_members_rows_as_the_module_does(per_member):
    torch.manual_seed(0)
    members = [Lookups(max_norm=1.0) for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    ids = torch.randint(0, 13, (3, 4, 5) if per_member else (4, 5))
    out = stack(ids, in_dims=0 if per_member else None)
    expected = torch.stack([m(ids[i] if per_member else ids) for i, m in enumerate(members)])
    assert_close(out, expected)
    for i, m in enumerate(members):  # the looked-up rows were renormalised in place
        assert_close(stack.module.embed.weight[i], m.embed.weight)


@pytest.mark.parametrize("backend", ["fused", "auto", "vmap"])
def test_torch_compile_of_a_vmapped_model_gives_the_loops_results(backend):
    # TorchDynamo cannot trace a custom Function's vmap rule (an internal error in torch
    # 2.13): the vmapped forward runs eagerly inside the compiled call, exactly.
    torch.manual_seed(0)
    members = [_seq(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                    nn.Linear(144, 3)) for _ in range(3)]  # fmt: skip
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    loop = phalanx.stack(copy.deepcopy(members), backend="loop")
    x = torch.randn(5, 1, 8, 8)
    compiled = torch.compile(stack, backend="eager")
    out = compiled(x)
    expected = loop(x)
    assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for p, q in zip(stack.parameters(), loop.parameters()):
        assert_close(p.grad, q.grad)


class GroupNormOf(nn.Module):
    """``F.group_norm`` on what a member's forward hands it: a transposed (strided) input, or
    a ``num_groups`` that does not divide the channels."""

    def __init__(self, channels: int, groups: int, transpose: bool = False) -> None:
        super().__init__()
        self.groups, self.transpose = groups, transpose
        self.weight = nn.Parameter(torch.rand(channels) + 0.5)
        self.bias = nn.Parameter(torch.randn(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transpose:
            x = x.transpose(-1, -2)
        return torch.nn.functional.group_norm(x, self.groups, self.weight, self.bias)


def test_group_norm_runs_through_its_speed_rule(monkeypatch):
    from phalanx.backends import rules

    route = rules.SPEED[torch.nn.functional.group_norm]
    calls = []
    monkeypatch.setitem(
        rules.SPEED,
        torch.nn.functional.group_norm,
        lambda args, kwargs: calls.append(1) or route(args, kwargs),
    )
    check_forward_and_gradients("fused", LAYERS[-1], "per_member", 3, True)
    assert calls


@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_group_norm_of_a_strided_input_runs_per_member_exactly(mode):
    arch = Arch("groupnorm_transposed", lambda: GroupNormOf(6, 3, transpose=True),
                lambda b: (torch.randn(b, 5, 6),))  # fmt: skip
    check_forward_and_gradients("fused", arch, mode, 3, True)


def test_group_norm_raises_what_a_member_alone_raises():
    members = [GroupNormOf(6, 4) for _ in range(3)]
    x = torch.randn(2, 6, 5)
    with pytest.raises(RuntimeError) as alone:
        members[0](x)
    stack = phalanx.stack(members, backend="fused")
    with pytest.raises(RuntimeError, match=re.escape(str(alone.value))):
        stack(x)
