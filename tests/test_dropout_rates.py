"""A dropout rate per member: members that differ only in a Dropout's ``p`` stack into one.

The loop is compared with each member alone exactly (it draws as the members alone do, one
after another from the global stream); one vmapped call draws every member's mask at once,
so there each member's keep rate is checked statistically and its scale exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import phalanx
from helpers import assert_close

RATES = (0.0, 0.25, 0.6, 1.0)
BATCHED = ("vmap", "fused")


def mlp(p: float, drop: type[nn.Module] = nn.Dropout) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), drop(p), nn.Linear(32, 3))


def members(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [mlp(p) for p in RATES]


def test_members_differing_only_in_p_stack_into_one():
    stack = phalanx.stack(members())
    assert len(stack) == len(RATES)
    assert list(stack.dropout_rates) == ["2"]
    assert stack.dropout_rates["2"].tolist() == list(RATES)
    # a rate every member shares stays the module's own p, as before
    same = phalanx.stack([mlp(0.3), mlp(0.3)])
    assert same.dropout_rates == {} and same.module[2].p == 0.3
    # a setting that is not per member still refuses, naming it
    with pytest.raises(ValueError, match=r"Dropout\(p=0.25, inplace=True\)"):
        phalanx.stack(
            [mlp(0.1), nn.Sequential(*list(mlp(0.1))[:2], nn.Dropout(0.25, True), nn.Linear(32, 3))]
        )


@pytest.mark.parametrize("backend", ["loop", *BATCHED, "auto"])
def test_eval_mode_equals_the_members_alone(backend):
    models = members()
    stack = phalanx.stack(models, backend=backend).eval()
    x = torch.randn(5, 6)
    out = stack(x)
    for i, m in enumerate(models):
        assert torch.equal(out[i], m.eval()(x))


def test_loop_in_training_equals_each_member_alone_exactly():
    models = members()
    stack = phalanx.stack(models, backend="loop")
    x = torch.randn(8, 6)
    torch.manual_seed(123)
    out = stack(x)
    torch.manual_seed(123)  # the loop draws member 0's mask, then member 1's, ... as alone
    alone = [m(x) for m in models]
    for i in range(len(models)):
        assert torch.equal(out[i], alone[i]), f"member {i} (p={RATES[i]})"
    assert not torch.equal(out[1], models[1].eval()(x))  # dropout did run
    assert torch.equal(out[3], models[3][3].bias.expand(8, 3))  # p=1: every entry dropped


@pytest.mark.parametrize("backend", BATCHED)
def test_batched_keep_rate_and_scale_per_member(backend):
    n_entries = 1 << 15
    stack = phalanx.stack([nn.Dropout(p) for p in RATES], backend=backend)
    x = torch.rand(n_entries) + 0.5  # no zeros: a zero in the output is a dropped entry
    torch.manual_seed(0)
    out = stack(x)
    assert stack.backend == backend
    assert torch.equal(out[0], x)  # p = 0: the input unchanged
    assert torch.equal(out[-1], torch.zeros_like(x))  # p = 1: every entry dropped
    for i, p in enumerate(RATES):
        kept = out[i] != 0
        q = 1 - p
        std = math.sqrt(q * p / n_entries)
        assert abs(kept.float().mean().item() - q) <= 5 * std + 1e-12, (i, p)
        scale = 1 / torch.tensor(q, dtype=torch.float64).float()  # ATen's (float)(1 - p)
        assert torch.equal(out[i][kept], x[kept] * scale), (i, p)
    # the masks are per member: two members of one rate draw different masks
    twins = phalanx.stack([nn.Dropout(0.5), nn.Dropout(0.5), nn.Dropout(0.2)], backend=backend)
    y = twins(x)
    assert not torch.equal(y[0] != 0, y[1] != 0)


@pytest.mark.parametrize("backend", ["loop", *BATCHED])
def test_gradients_are_the_mask_times_the_scale(backend):
    stack = phalanx.stack([nn.Dropout(p) for p in RATES], backend=backend)
    x = (torch.rand(len(RATES), 4096) + 0.5).requires_grad_()
    out = stack(x, in_dims=0)
    g = torch.randn_like(out)
    out.backward(g)
    noise = out.detach() / x.detach()  # each member's mask times its scale
    assert_close(x.grad, g * noise)
    assert torch.equal(x.grad[-1], torch.zeros(4096))  # p = 1: no gradient
    assert torch.equal(x.grad[0], g[0])  # p = 0: the gradient passes unchanged


@pytest.mark.parametrize("backend", ["loop", *BATCHED])
def test_channel_dropout_drops_whole_channels_at_each_rate(backend):
    stack = phalanx.stack([nn.Dropout2d(p) for p in RATES], backend=backend)
    x = torch.rand(64, 32, 3, 3) + 0.5
    torch.manual_seed(1)
    out = stack(x)
    planes = (out != 0).flatten(-2)  # (N, B, C, H*W)
    assert torch.equal(planes.all(-1), planes.any(-1))  # a channel is kept or dropped whole
    kept = planes.any(-1).float().mean((1, 2))
    for i, p in enumerate(RATES):
        std = math.sqrt(p * (1 - p) / (64 * 32))
        assert abs(kept[i].item() - (1 - p)) <= 5 * std + 1e-12, (i, p)


def test_unstack_getitem_setitem_and_copy_to_carry_each_members_p():
    stack = phalanx.stack(members())
    assert [m[2].p for m in stack.unstack()] == list(RATES)
    assert stack[1][2].p == 0.25 and stack[-1][2].p == 1.0
    stack[1] = mlp(0.4)
    assert stack.dropout_rates["2"].tolist() == [0.0, 0.4, 0.6, 1.0]
    targets = [mlp(0.9) for _ in RATES]
    stack.copy_to(targets)
    assert [m[2].p for m in targets] == [0.0, 0.4, 0.6, 1.0]
    # one member's new rate makes a shared rate per member
    same = phalanx.stack([mlp(0.3), mlp(0.3)])
    same[0] = mlp(0.1)
    assert same.dropout_rates["2"].tolist() == [0.1, 0.3]


def test_keep_members_and_a_factory_keep_the_rates():
    stack = phalanx.stack(members())
    smaller = phalanx.population.keep_members(stack, [3, 1])
    assert smaller.dropout_rates["2"].tolist() == [1.0, 0.25]
    built = phalanx.stack(lambda i: mlp(RATES[i]), num_members=4, seed=0)
    assert built.dropout_rates["2"].tolist() == list(RATES)


def test_save_load_round_trip_keeps_the_rates(tmp_path):
    stack = phalanx.stack(members())
    path = tmp_path / "stack.safetensors"
    phalanx.save(path, stack)
    fresh = phalanx.stack([mlp(0.5) for _ in RATES])  # one rate for all
    phalanx.load(path, fresh)
    assert fresh.dropout_rates["2"].tolist() == list(RATES)
    x = torch.randn(5, 6)
    assert torch.equal(fresh.eval()(x), stack.eval()(x))
    # a checkpoint of members that share one rate gives every member the module's rate
    phalanx.save(path, phalanx.stack([mlp(0.5) for _ in RATES]))
    phalanx.load(path, fresh)
    assert fresh.dropout_rates == {}
    # torch's own state dict round trip too
    state = stack.state_dict()
    assert state["dropout_rates.2"].tolist() == list(RATES)
    fresh.load_state_dict(state)
    assert fresh.dropout_rates["2"].tolist() == list(RATES)


def test_a_padded_stack_keeps_each_members_rate():
    torch.manual_seed(0)
    models = [
        nn.Sequential(nn.Linear(6, w), nn.ReLU(), nn.Dropout(p), nn.Linear(w, 3))
        for w, p in [(4, 0.1), (9, 0.5), (6, 0.0)]
    ]
    stack = phalanx.stack(models, pad_widths=True, backend="loop")
    assert stack.dropout_rates["2"].tolist() == [0.1, 0.5, 0.0]
    assert [m[2].p for m in stack.unstack()] == [0.1, 0.5, 0.0]
    x = torch.randn(5, 6)
    out = stack.eval()(x)  # (in training a padded member draws masks over its padded width)
    for i, m in enumerate(models):
        assert_close(out[i], m.eval()(x))


def test_subsets_and_a_list_stacked_in_place_use_each_members_rate():
    stack = phalanx.stack([nn.Dropout(p) for p in RATES], backend="vmap")
    x = torch.rand(64) + 0.5
    out = stack(x, subset=[3, 0])
    assert torch.equal(out[0], torch.zeros_like(x)) and torch.equal(out[1], x)
    models = members()
    loop = phalanx.stack(models, backend="loop")
    x = torch.randn(8, 6)
    torch.manual_seed(5)
    out = loop(x, subset=[2, 1])
    torch.manual_seed(5)
    assert torch.equal(out[0], models[2](x)) and torch.equal(out[1], models[1](x))

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList(members())

    model = Heads()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    phalanx.stack_in_place(model, "heads", backend="loop")
    assert set(model.state_dict()) == set(before)  # the list's keys, no rates of their own
    assert model.heads[1][2].p == 0.25
    torch.manual_seed(9)
    alone = model.heads[3](x)
    assert torch.equal(alone, model.heads[3][3].bias.expand(8, 3))  # p = 1 as member 3 alone
    model.heads[0] = mlp(0.8)
    assert model.heads.dropout_rates["2"].tolist() == [0.8, 0.25, 0.6, 1.0]


def test_a_captured_step_sees_rates_changed_after_its_capture():
    import torch.nn.functional as F

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 16), nn.Dropout(p), nn.Linear(16, 3)) for p in (0.0, 1.0)]
    stack = phalanx.stack(models, backend="fused")
    opt = phalanx.optim.SGD(stack.parameters(), lr=0.1)
    step = phalanx.compile_step(stack, F.cross_entropy, opt, backend="eager", prefer="captured")
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    for _ in range(5):
        step(x, y)
    assert step.report.startswith("captured")
    other = [nn.Sequential(nn.Linear(4, 16), nn.Dropout(p), nn.Linear(16, 3)) for p in (1.0, 0.5)]
    stack.load_state_dict(phalanx.stack(other).state_dict())  # member 0 now drops everything
    before = stack.module[0].weight.detach().clone()
    step(x, y)
    assert torch.equal(stack.module[0].weight[0], before[0])  # p = 1: no gradient reaches it
    assert not torch.equal(stack.module[0].weight[1], before[1])


def test_a_checkpointed_region_recomputes_with_the_members_rate():
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.fc, self.drop, self.head = nn.Linear(6, 32), nn.Dropout(p), nn.Linear(32, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(lambda t: self.drop(self.fc(t)), x, use_reentrant=False)
            return self.head(h)

    torch.manual_seed(0)
    models = [Block(p) for p in RATES]
    stack = phalanx.stack(models, backend="loop")
    x = torch.randn(8, 6)
    torch.manual_seed(3)
    stack(x).sum().backward()
    torch.manual_seed(3)
    for i, m in enumerate(models):
        m(x).sum().backward()
        assert torch.equal(stack.module.fc.weight.grad[i], m.fc.weight.grad), f"member {i}"
