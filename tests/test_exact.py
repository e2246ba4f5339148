"""Exact or refuse: every reproducer of a silent wrong answer or a crash, now a test.

Each case compares a stack with the N original modules run one by one (the loop), or checks
that phalanx refuses with a message that names what differs.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from conftest import assert_close
from phalanx._backends import BackendRefusal
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


# ------------------------------------------------------------------- the check never samples


class CentresInTraining(nn.Module):
    """Parameter-free, mixes the batch only in training: an eval call must not vouch for it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0) if self.training else x


class CentresLargeBatches(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0) if x.shape[0] > 64 else x


@pytest.mark.parametrize("layer", [CentresInTraining, CentresLargeBatches])
def test_a_case_never_checked_is_checked_before_it_is_trusted(layer):
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 3), layer()) for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    if layer is CentresInTraining:
        stack.eval()
        stack(torch.randn(8, 4))  # fused is exact in eval mode
        stack.train()
        x = torch.randn(8, 4)
    else:
        for b in range(1, 20):  # more signatures than the old check ever looked at
            stack(torch.randn(b, 4))
        x = torch.randn(100, 4)
    with pytest.raises(BackendRefusal, match="does not match the reference on this input"):
        stack(x)
    auto = phalanx.stack(copy.deepcopy(members))
    if layer is CentresInTraining:
        auto.eval()
        auto(torch.randn(8, 4))
        auto.train()
        for m in members:
            m.train()
    with warnings.catch_warnings():
        # auto announces the hand-over when it ran fused before; its race may have kept a
        # simpler backend from the start, which needs no hand-over: the answer is what counts.
        warnings.simplefilter("ignore")
        out = auto(x)
    assert_close(out, torch.stack([m(x) for m in members]))
    assert auto.backend != "fused"


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
    for backend in BACKENDS:
        stack = phalanx.stack(copy.deepcopy(members), backend=backend)
        assert_close(stack(x), expected, msg=backend)


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


class MixesBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h - h.mean(0)


def test_the_fallback_warning_names_the_backend_auto_runs():
    stack = phalanx.stack([MixesBatch() for _ in range(3)])
    with pytest.warns(UserWarning) as record:
        stack(torch.randn(5, 4))
    messages = [str(w.message) for w in record if "phalanx" in str(w.message)]
    assert len(messages) == 1, messages
    assert f"backend 'auto' runs {stack.backend!r} instead" in messages[0]
    assert f"backend={stack.backend!r}" in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # announced once, not on every call
        stack(torch.randn(5, 4))


def test_the_pick_prefers_fused_then_the_loop_within_the_margin(monkeypatch):
    from phalanx._backends import _auto

    def race(table: dict[str, float]) -> str:
        calls = []

        def seconds(fn, device, repeats=1):
            fn()
            calls.append(fn.args[0])
            return table[fn.args[0]]

        monkeypatch.setattr(_auto, "seconds", seconds)
        stack = phalanx.stack([nn.Linear(3, 2) for _ in range(2)])
        choice = _auto.AutoBackend._race(
            stack._view, ["fused", "vmap", "loop"], (torch.randn(2, 3),), {}, (None,)
        )
        rounds = ["fused", "vmap", "loop"] * _auto.ROUNDS
        assert calls == ["fused", "vmap", "loop", *rounds], "warm-up, then interleaved rounds"
        return choice

    assert race({"fused": 1.0, "vmap": 1.0, "loop": 0.97}) == "fused", "3% is within the margin"
    assert race({"fused": 1.0, "vmap": 0.97, "loop": 2.0}) == "fused", "fused before vmap"
    assert race({"fused": 2.0, "vmap": 0.97, "loop": 1.0}) == "loop", "the loop before vmap"
    assert race({"fused": 1.0, "vmap": 1.0, "loop": 0.9}) == "loop", "10% faster is taken"
    assert race({"fused": 0.5, "vmap": 1.0, "loop": 1.0}) == "fused", "twice as fast is taken"


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


def test_vmap_refuses_what_it_gets_silently_wrong_and_auto_hands_over():
    """torch.func gives an Embedding's padding row a gradient under per-member indices."""
    torch.manual_seed(0)
    members = [EmbeddingNet() for _ in range(3)]  # an Embedding with padding_idx=0
    idx = torch.randint(0, 11, (3, 5, 6))
    idx[:, :, 0] = 0
    with pytest.raises(BackendRefusal, match="padding_idx on per-member indices"):
        phalanx.stack(copy.deepcopy(members), backend="vmap")(idx, in_dims=0)
    for backend in ["auto", "fused", "loop"]:
        stack = phalanx.stack(copy.deepcopy(members), backend=backend)
        stack(idx, in_dims=0).square().sum().backward()
        assert stack.module.embed.weight.grad[:, 0].abs().max() == 0, backend


def test_the_race_leaves_the_gradients_as_it_found_them(caplog):
    """auto times backward into .grad, as training does, and puts the .grad found back."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(3)]
    x = torch.randn(5, 4)
    stack = phalanx.stack(members)
    marked = {k: torch.full_like(p, 7.0) for k, p in stack.named_parameters()}
    for k, p in stack.named_parameters():
        p.grad = marked[k].clone()
    with caplog.at_level(logging.INFO, logger="phalanx"):
        out = stack(x)  # the first call races: forward and backward of every backend
    assert any("timed" in r.getMessage() for r in caplog.records), "the race did not run"
    for k, p in stack.named_parameters():
        assert torch.equal(p.grad, marked[k]), f"{k}: the race changed .grad"
    stack.zero_grad()
    out.sum().backward()
    fresh = phalanx.stack(members, backend="loop")
    fresh(x).sum().backward()
    for (k, p), q in zip(stack.named_parameters(), fresh.parameters()):
        assert_close(p.grad, q.grad, msg=k)
