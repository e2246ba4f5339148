"""Exact or refuse: every reproducer of a silent wrong answer or a crash, now a test.

Each case compares a stack with the N original modules run one by one (the loop), or checks
that phalanx refuses with a message that names what differs.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from helpers import assert_close
from phalanx.backends import BackendRefusal
from test_fused import EmbeddingNet

BACKENDS = ["auto", "fused", "vmap", "loop"]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 2))


def _matches_the_loop(members: list[nn.Module], backend: str, x: torch.Tensor) -> None:
    """A stack of copies of ``members`` on a shared ``x``: outputs and parameter gradients
    against the members run one by one."""
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    out = stack(x)
    assert_close(out, torch.stack([m(x) for m in members]))
    out.sum().backward()
    for i, m in enumerate(members):
        m(x).sum().backward()
        for name, p in m.named_parameters():
            assert_close(stack.module.get_parameter(name).grad[i], p.grad, msg=f"{i} {name}")


# --------------------------------------------------------------------- second derivatives


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["shared", "per_member"])
def test_gradient_penalty_matches_the_loop(backend, mode):
    """WGAN-GP style: the input gradient's norm is part of the loss (create_graph=True)."""
    torch.manual_seed(0)
    members = [_mlp() for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    x = torch.randn(3, 5, 10) if mode == "per_member" else torch.randn(5, 10)
    xs = x.clone().requires_grad_(True)
    out = stack(xs, in_dims=0 if mode == "per_member" else None)
    (g,) = torch.autograd.grad(out.sum(), xs, create_graph=True)
    assert g.requires_grad, "the input gradient must carry its graph"
    (out.square().sum() + g.square().sum()).backward()

    # The loop: the same loss over the N original modules (a shared input's gradient sums
    # over the members, as it does for the stack).
    if mode == "per_member":
        ref_x = [x[i].clone().requires_grad_(True) for i in range(len(members))]
    else:
        ref_x = [x.clone().requires_grad_(True)] * len(members)
    outs = [m(xi) for m, xi in zip(members, ref_x)]
    leaves = ref_x if mode == "per_member" else ref_x[:1]
    ref_g = torch.autograd.grad(sum(o.sum() for o in outs), leaves, create_graph=True)
    (sum(o.square().sum() for o in outs) + sum(gi.square().sum() for gi in ref_g)).backward()
    for i, m in enumerate(members):
        for name, p in m.named_parameters():
            assert_close(stack.module.get_parameter(name).grad[i], p.grad, msg=f"{i} {name}")


@pytest.mark.parametrize("backend", ["auto", "fused"])
def test_hessian_vector_product_matches_the_loop(backend):
    torch.manual_seed(1)
    members = [_mlp() for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    x = torch.randn(4, 10)
    params = list(stack.parameters())
    vs = [torch.randn_like(p) for p in params]
    grads = torch.autograd.grad(stack(x).square().sum(), params, create_graph=True)
    hvp = torch.autograd.grad(grads, params, vs)
    names = [n for n, _ in stack.module.named_parameters()]
    for i, m in enumerate(members):
        mp = [m.get_parameter(n) for n in names]
        gi = torch.autograd.grad(m(x).square().sum(), mp, create_graph=True)
        hi = torch.autograd.grad(gi, mp, [v[i] for v in vs])
        for name, h, r in zip(names, hvp, hi):
            assert_close(h[i], r, msg=f"member {i} {name}")


# ------------------------------------------- a forward across its batch, in every case


class CentresInTraining(nn.Module):
    """Parameter-free, mixes the batch only in training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0) if self.training else x


class CentresLargeBatches(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0) if x.shape[0] > 64 else x


@pytest.mark.parametrize("layer", [CentresInTraining, CentresLargeBatches])
@pytest.mark.parametrize("backend", ["fused", "auto"])
def test_a_forward_mixing_its_batch_is_per_member_in_every_case(layer, backend):
    # Under vmap a mean over dim 0 is each member's own mean, whatever the mode or shape:
    # there is no case a check could have missed.
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 3), layer()) for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    for train in (False, True):
        stack.train(train)
        for m in members:
            m.train(train)
        for b in (1, 8, 100):
            x = torch.randn(b, 4)
            assert_close(stack(x), torch.stack([m(x) for m in members]))
    assert stack.backend == "fused"


# ------------------------------------------------------------ member 0 does not stand in


class Scaled(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.k


def test_plain_attributes_that_differ_are_refused():
    with pytest.raises(
        ValueError, match=r"member 1 the root module has k=100.0, member 0 has k=1.0"
    ):
        phalanx.stack([Scaled(1.0), Scaled(100.0)])
    phalanx.stack([Scaled(2.0), Scaled(2.0)])  # equal settings are fine


def test_a_hook_on_one_member_only_is_refused():
    members = [nn.Linear(3, 3) for _ in range(2)]
    members[1].register_forward_hook(lambda m, i, o: o * 2)
    with pytest.raises(ValueError, match=r"member 1 the root module has 1 forward hook\(s\), "
                       r"member 0 has 0"):  # fmt: skip
        phalanx.stack(members)


def test_the_same_hook_on_every_member_is_honoured():
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(3, 4), nn.ReLU()) for _ in range(3)]
    for m in members:
        m[0].register_forward_hook(lambda m, i, o: o * 2)
    x = torch.randn(5, 3)
    expected = torch.stack([m(x) for m in members])
    for backend in ("fused", "vmap", "loop"):
        stack = phalanx.stack(copy.deepcopy(members), backend=backend)
        if backend in ("fused", "vmap"):  # a hook runs once per member: only the loop can
            with pytest.raises(BackendRefusal, match="which must run once per member"):
                stack(x)
            continue
        assert_close(stack(x), expected, msg=backend)
    stack = phalanx.stack(copy.deepcopy(members))
    with pytest.warns(UserWarning, match="backend 'auto' runs 'loop' instead"):
        assert_close(stack(x), expected, msg="auto")


def test_a_submodule_shared_between_members_is_refused():
    shared = nn.Linear(3, 3)
    members = [nn.Sequential(shared, nn.Linear(3, 1)), nn.Sequential(shared, nn.Linear(3, 1))]
    with pytest.raises(ValueError, match=r"member 1 '0.weight' is the same tensor as member 0 "
                       r"'0.weight'"):  # fmt: skip
        phalanx.stack(members)


class TinyLM(nn.Module):
    """nanoGPT's weight tying: the output layer is the embedding's transpose."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11, bias=False)
        if tie:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.wte(idx)))


def test_members_tied_unlike_member_0_are_refused():
    with pytest.raises(ValueError, match=r"member 1 ties none, member 0 ties head.weight = "
                       r"wte.weight"):  # fmt: skip
        phalanx.stack([TinyLM(tie=True), TinyLM(tie=False)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_tying_inside_each_member_is_kept(backend):
    torch.manual_seed(0)
    members = [TinyLM() for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    idx = torch.randint(0, 11, (4, 6))
    out = stack(idx)
    out.square().sum().backward()
    names = [n for n, _ in stack.module.named_parameters()]
    assert "wte.weight" in names and "head.weight" not in names, "one stacked tensor for the tie"
    for i, m in enumerate(members):
        o = m(idx)
        assert_close(out[i], o, msg=f"member {i}")
        o.square().sum().backward()  # the tied weight accumulates both uses' gradients
        assert_close(stack.module.wte.weight.grad[i], m.wte.weight.grad, msg=f"grad {i}")
    back = stack.unstack()
    assert all(m.head.weight is m.wte.weight for m in back), "unstack() keeps the tie"


# ------------------------------------------------------------------- auto hands over


class Forecaster(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = cell(3, 8, batch_first=True)
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.fc(out[:, -1, :])


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("backend", ["auto", "fused"])
def test_recurrent_members_run_exactly(cell, backend):
    torch.manual_seed(0)
    members = [Forecaster(cell) for _ in range(3)]
    _matches_the_loop(members, backend, torch.randn(4, 7, 3))


def test_vmap_refusal_is_typed_and_auto_hands_over_for_any_failure():
    torch.manual_seed(0)
    members = [Forecaster(nn.LSTM) for _ in range(2)]
    x = torch.randn(4, 7, 3)
    with pytest.raises(BackendRefusal, match="backend 'vmap' cannot run this architecture"):
        phalanx.stack(copy.deepcopy(members), backend="vmap")(x)


def test_old_style_spectral_norm_runs_under_auto():
    torch.manual_seed(0)
    members = [nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4)), nn.ReLU()) for _ in range(3)]
    for m in members:
        m.eval()
    stack = phalanx.stack(copy.deepcopy(members))
    x = torch.randn(5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = stack(x)
    assert_close(out, torch.stack([m(x) for m in members]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_parametrized_members_run_exactly(backend):
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 5)), nn.Tanh())
        for _ in range(3)
    ]
    _matches_the_loop(members, backend, torch.randn(6, 4))


def test_a_meta_input_is_refused():
    stack = phalanx.stack([nn.Linear(3, 2) for _ in range(2)])
    with pytest.raises(ValueError, match=r"input 0 is on the meta device, the stack's parameters "
                       r"on cpu"):  # fmt: skip
        stack(torch.randn(4, 3, device="meta"))


# -------------------------------------------------------------------- what auto says


class Normalises(nn.Module):
    """Divides by a Python number taken from the member's data."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h / max(h.abs().max().item(), 1.0)


def test_the_fallback_warning_names_the_backend_auto_runs():
    stack = phalanx.stack([Normalises() for _ in range(3)])
    with pytest.warns(UserWarning) as record:
        stack(torch.randn(5, 4))
    messages = [str(w.message) for w in record if "phalanx" in str(w.message)]
    assert len(messages) == 1, messages
    assert f"backend 'auto' runs {stack.backend!r} instead" in messages[0]
    assert f"backend={stack.backend!r}" in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # announced once, not on every call
        stack(torch.randn(5, 4))


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x)


def test_auto_runs_the_members_forward_once_per_call():
    # No trial runs and no race: fused runs the real call, once, for all members.
    stack = phalanx.stack([Counts() for _ in range(3)])
    stack(torch.randn(4, 3))
    stack(torch.randn(4, 3))
    assert stack.module.calls == 2, "fused: one forward a call, under vmap"


def test_compiling_an_auto_stack_gives_the_eager_results():
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(members))
    x = torch.randn(4, 6)
    compiled = torch.compile(stack, backend="eager")
    assert_close(compiled(x), torch.stack([m(x) for m in members]))
    assert_close(compiled(x), stack(x))


def test_functional_idioms_of_real_models_run_fused():
    """What the fused path refused before: flatten(1), view(size(0), -1), cat on dim 1,
    functional pooling, a module holding raw parameters."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 3, 3)
            self.fc = nn.Linear(3 * 3 * 3 + 2, 4)
            self.scale = nn.Parameter(torch.rand(4))

        def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
            h = F.max_pool2d(F.relu(self.conv(x)), 2)
            h = h.view(h.size(0), -1)
            h = torch.cat([h.flatten(1), a], 1)
            return self.fc(h) * self.scale

    torch.manual_seed(0)
    members = [Net() for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    x, a = torch.randn(5, 1, 8, 8), torch.randn(5, 2)
    out = stack(x, a)
    assert_close(out, torch.stack([m(x, a) for m in members]))


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
def test_padding_rows_take_no_gradient_on_every_backend(backend):
    """torch.func's own rule gives an Embedding's padding row a gradient under per-member
    indices; phalanx's embedding rule, used by fused and vmap, keeps it out."""
    torch.manual_seed(0)
    members = [EmbeddingNet() for _ in range(3)]  # an Embedding with padding_idx=0
    idx = torch.randint(0, 11, (3, 5, 6))
    idx[:, :, 0] = 0
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    stack(idx, in_dims=0).square().sum().backward()
    assert stack.module.embed.weight.grad[:, 0].abs().max() == 0, backend
    loop = phalanx.stack(copy.deepcopy(members), backend="loop")
    loop(idx, in_dims=0).square().sum().backward()
    assert_close(stack.module.embed.weight.grad, loop.module.embed.weight.grad)


def test_auto_leaves_the_gradients_as_it_found_them():
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(3)]
    x = torch.randn(5, 4)
    stack = phalanx.stack(members)
    marked = {k: torch.full_like(p, 7.0) for k, p in stack.named_parameters()}
    for k, p in stack.named_parameters():
        p.grad = marked[k].clone()
    out = stack(x)
    for k, p in stack.named_parameters():
        assert torch.equal(p.grad, marked[k]), f"{k}: the first call changed .grad"
    stack.zero_grad()
    out.sum().backward()
    fresh = phalanx.stack(members, backend="loop")
    fresh(x).sum().backward()
    for (k, p), q in zip(stack.named_parameters(), fresh.parameters()):
        assert_close(p.grad, q.grad, msg=k)


class Options:
    def __init__(self, pad: int, scale: float) -> None:
        self.pad, self.scale = pad, scale


class Configured(nn.Module):
    def __init__(self, pad: int, scale: float = 1.0) -> None:
        super().__init__()
        self.config = Options(pad, scale)
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.config.scale


def test_config_objects_that_differ_are_refused():
    # A Hugging Face PretrainedConfig is such an object: compared field by field, not by type.
    with pytest.raises(
        ValueError, match=r"member 1 the root module has config.pad=1 where member 0 has 0"
    ):
        phalanx.stack([Configured(0), Configured(1)])
    with pytest.raises(
        ValueError, match=r"member 2 the root module has config.scale=3.0 where member 0 has 2.0"
    ):
        phalanx.stack([Configured(0, 2.0), Configured(0, 2.0), Configured(0, 3.0)])
    phalanx.stack([Configured(0, 2.0), Configured(0, 2.0)])  # equal configs stack
