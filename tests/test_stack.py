"""Stack behaviour beyond the conformance table: errors, export, modes, randomness."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from helpers import ARCHS, assert_close, make_members, reference_outputs


def _q2_members(n: int = 3) -> list[nn.Module]:
    return make_members(ARCHS[1], n)


# ------------------------------------------------------------------------------------ bad input


def test_empty_list_is_rejected():
    with pytest.raises(ValueError, match=r"phalanx.stack\(\): got no members"):
        phalanx.stack([])


def test_non_module_members_are_named():
    with pytest.raises(TypeError, match=r"member 1 is a str; member 2 is a int"):
        phalanx.stack([nn.Linear(2, 2), "linear", 3])


def test_a_single_module_is_not_a_list():
    with pytest.raises(TypeError, match=r"got a single Linear. Pass a list"):
        phalanx.stack(nn.Linear(2, 2))


def test_every_architecture_difference_is_listed_once():
    members = [
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),  # type differs
        nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)),  # shapes differ
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2, bias=False)),  # missing bias
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double(),  # dtype differs
    ]
    with pytest.raises(ValueError) as info:
        phalanx.stack(members)
    text = str(info.value)
    assert "member 1 submodule '1' is a Tanh, member 0 has a ReLU" in text
    assert "member 2 parameter '0.weight' has shape (6, 4), member 0 has (8, 4)" in text
    assert "member 2 parameter '2.weight' has shape (2, 6), member 0 has (2, 8)" in text
    assert "member 3 has no parameter '2.bias', member 0 has one" in text
    assert "member 4 parameter '0.weight' has dtype torch.float64" in text
    assert text.count("phalanx.stack()") == 1
    assert text.endswith(
        "All members must share one architecture: the same module types, "
        "parameter and buffer names, shapes, dtypes, devices, train/eval mode, settings, hooks "
        "and ties; only tensor values may differ."
    )


def test_extra_parameter_and_buffer_differences_are_listed():
    a = nn.BatchNorm1d(3)
    b = nn.BatchNorm1d(3, track_running_stats=False)
    with pytest.raises(
        ValueError, match=r"member 1 buffer 'running_mean' is None, in member 0 a tensor"
    ):
        phalanx.stack([a, b])
    c = nn.Linear(2, 2)
    d = nn.Linear(2, 2)
    d.register_parameter("extra", nn.Parameter(torch.zeros(1)))
    with pytest.raises(ValueError, match=r"member 1 has an extra parameter 'extra'"):
        phalanx.stack([c, d])


def test_members_on_different_devices_are_rejected():
    members = [nn.Linear(2, 2), nn.Linear(2, 2).to("meta")]
    with pytest.raises(
        ValueError, match=r"member 1 parameter 'weight' is on meta, member 0 on cpu"
    ):
        phalanx.stack(members)


def test_members_in_different_modes_are_rejected():
    members = _q2_members()
    members[2].eval()
    with pytest.raises(
        ValueError,
        match=r"member 2 the root module is in eval mode, member 0 in "
        r"train mode; call .train\(\) or .eval\(\)",
    ):
        phalanx.stack(members)


def test_frozen_and_trainable_members_are_rejected():
    members = _q2_members(2)
    members[1][0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"member 1 parameter '0.weight' has requires_grad=False"):
        phalanx.stack(members)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match=r"unknown backend 'fast'; choose one of 'auto', "):
        phalanx.stack(_q2_members(), backend="fast")
    stack = phalanx.stack(_q2_members())
    with pytest.raises(ValueError, match=r"Stack.backend: unknown backend 'gpu'"):
        stack.backend = "gpu"


def test_per_member_input_of_wrong_size_explains_split():
    stack = phalanx.stack(make_members(ARCHS[0], 400))
    with pytest.raises(
        ValueError,
        match=r"Stack.forward\(\): with in_dims=0 the input's first dimension must be the number "
        r"of members, 400; got a tensor of shape \(32, 8000\). For one wide input sliced across "
        r"members, use phalanx.split\(x, 400, dim=1\)",
    ):
        stack(torch.randn(32, 8000), in_dims=0)


def test_in_dims_must_match_inputs():
    stack = phalanx.stack(make_members(ARCHS[5], 2))
    with pytest.raises(ValueError, match=r"in_dims has 1 entries but 2 positional inputs"):
        stack(torch.randn(3, 5), torch.randn(3, 3), in_dims=(0,))
    with pytest.raises(
        ValueError, match=r"must be None \(shared\) or 0 \(per-member\); input 1 has 1"
    ):
        stack(torch.randn(3, 5), torch.randn(3, 2, 3), in_dims=(None, 1))
    with pytest.raises(
        TypeError, match=r"input 0 is marked per-member \(in_dims=0\) but is a float"
    ):
        stack(1.0, torch.randn(3, 3), in_dims=(0, None))


def test_split_of_indivisible_width_is_rejected():
    with pytest.raises(
        ValueError,
        match=r"dimension 1 of the input has size 8001, which is not "
        r"divisible by 400 members",
    ):
        phalanx.split(torch.randn(32, 8001), 400, dim=1)


class DataDependent(nn.Module):
    """Python control flow on tensor values: vmap cannot batch it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:
            return h
        return -h


def test_vmap_refusal_is_explained_and_auto_falls_back_loudly():
    torch.manual_seed(0)
    members = [DataDependent() for _ in range(3)]
    x = torch.randn(4, 3)
    expected = reference_outputs(members, (x,), (None,))

    stack = phalanx.stack(copy.deepcopy(members), backend="vmap")
    with pytest.raises(
        RuntimeError,
        match=r"(?s)backend 'vmap' cannot run this architecture.*"
        r"backend='loop'",
    ):
        stack(x)

    stack = phalanx.stack(copy.deepcopy(members))
    with pytest.warns(
        UserWarning,
        match=r"backend 'fused' cannot run this model exactly \(the member's forward turns its "
        r"data into a Python value.*\); backend 'auto' runs 'loop' instead",
    ):
        out = stack(x)
    assert stack.backend == "loop"
    assert_close(out, expected)


def test_a_user_error_is_not_mistaken_for_a_vmap_limit():
    stack = phalanx.stack(_q2_members())
    with pytest.raises(
        RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied|batch2 tensor to be"
    ):
        stack(torch.randn(4, 11))
    assert stack.backend == "fused", "a user's error must not make auto fall back"


# ---------------------------------------------------------------------------------- sliced input


def test_question_one_reads_as_split_stack_merge():
    torch.manual_seed(0)
    members = make_members(ARCHS[0], 400)
    stack = phalanx.stack(members)
    x = torch.randn(32, 20 * 400)
    y = phalanx.merge(stack(phalanx.split(x, 400, dim=1), in_dims=0), dim=1)
    assert y.shape == (32, 400)
    for i in (0, 1, 217, 399):
        assert_close(y[:, i : i + 1], members[i](x[:, 20 * i : 20 * i + 20]), msg=f"member {i}")


def test_split_is_a_view_and_merge_inverts_it():
    x = torch.randn(5, 12)
    xs = phalanx.split(x, 3, dim=1)
    assert xs.shape == (3, 5, 4)
    assert xs.data_ptr() == x.data_ptr() and xs._base is x
    torch.testing.assert_close(xs[1], x[:, 4:8], rtol=0, atol=0)
    torch.testing.assert_close(phalanx.merge(xs, dim=1), x, rtol=0, atol=0)


# --------------------------------------------------------------------------------- export / state


def test_unstack_gives_independent_ordinary_modules():
    members = _q2_members()
    stack = phalanx.stack(members)
    with torch.no_grad():
        for p in stack.parameters():
            p.add_(0.5)  # "training"
    x = torch.randn(6, 10)
    out = stack(x)
    models = stack.unstack()
    assert [type(m) for m in models] == [nn.Sequential] * 3
    for i, m in enumerate(models):
        assert_close(m(x), out[i], msg=f"member {i}")
        assert m[0].weight.device == x.device and m[0].weight.requires_grad
    with torch.no_grad():
        models[0][0].weight.zero_()
    assert stack.module[0].weight[0].abs().sum() > 0, "unstack() must copy, not share"


def test_copy_to_writes_back_in_place_and_checks_shapes():
    members = make_members(ARCHS[3], 3)  # CNN with BatchNorm buffers
    stack = phalanx.stack(members)
    stack(torch.randn(4, 2, 8, 8))  # updates the stacked running statistics
    weights = [m[0].weight for m in members]
    stack.copy_to(members)
    for i, m in enumerate(members):
        assert m[0].weight is weights[i], "copy_to must write into the existing tensors"
        assert_close(m[1].running_mean, stack.module[1].running_mean[i])
        assert_close(m[0].weight, stack.module[0].weight[i])
    with pytest.raises(ValueError, match=r"the stack has 3 members but 2 modules were given"):
        stack.copy_to(members[:2])
    wrong = make_members(ARCHS[3], 3)
    wrong[1][5] = nn.Linear(64, 4)
    with pytest.raises(
        ValueError,
        match=r"member 1 parameter '5.weight' has shape \(4, 64\), the "
        r"stack has \(3, 64\)",
    ):
        stack.copy_to(wrong)


def test_state_dict_round_trip():
    # One backend for both: under auto each stack races on its own, and two backends agree
    # to float rounding, not bit for bit.
    a = phalanx.stack(make_members(ARCHS[3], 3, seed=0), backend="fused")
    b = phalanx.stack(make_members(ARCHS[3], 3, seed=10), backend="fused")
    a(torch.randn(4, 2, 8, 8))
    state = a.state_dict()
    assert state["module.0.weight"].shape == (3, 4, 2, 3, 3)
    assert state["module.1.num_batches_tracked"].shape == (3,)
    b.load_state_dict(state)
    a.eval()
    b.eval()
    x = torch.randn(4, 2, 8, 8)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_to_dtype_moves_every_member():
    members = _q2_members()
    stack = phalanx.stack(members).to(torch.float64)
    x = torch.randn(6, 10, dtype=torch.float64)
    expected = reference_outputs([m.double() for m in members], (x,), (None,))
    assert_close(stack(x), expected, dtype=torch.float64)
    assert all(m[0].weight.dtype == torch.float64 for m in stack.unstack())


def test_train_and_eval_switch_every_member():
    stack = phalanx.stack(make_members(ARCHS[3], 2))
    stack.eval()
    assert not any(m.training for m in stack.modules())
    assert not any(m.training for u in stack.unstack() for m in u.modules())
    stack.train()
    assert all(m.training for m in stack.modules())


def test_frozen_parameters_stay_frozen_under_torch_optim():
    members = _q2_members()
    for m in members:
        m[0].weight.requires_grad_(False)
    stack = phalanx.stack(members)
    frozen = stack.module[0].weight.clone()
    assert not stack.module[0].weight.requires_grad
    opt = torch.optim.Adam(stack.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = stack.module[2].weight.clone()
    for _ in range(3):
        opt.zero_grad()
        phalanx.member_losses(
            F.cross_entropy, stack(torch.randn(8, 10)), torch.randint(0, 2, (8,))
        ).sum().backward()
        opt.step()
        sched.step()
    assert torch.equal(stack.module[0].weight, frozen)
    assert not torch.equal(stack.module[2].weight, before)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


# ---------------------------------------------------------------------------------- randomness


@pytest.mark.parametrize("backend", ["loop", "vmap", "auto"])
def test_dropout_draws_a_mask_per_member_reproducibly(backend):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 64), nn.Dropout(0.5))
    stack = phalanx.stack([copy.deepcopy(base) for _ in range(4)], backend=backend)
    x = torch.randn(16, 6)
    torch.manual_seed(7)
    out = stack(x)
    torch.manual_seed(7)
    again = stack(x)
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    h = base[0](x)
    for i in range(4):
        kept = out[i] != 0
        # Each member's output is its own pre-dropout activation, scaled by 1/(1-p), masked.
        torch.testing.assert_close(out[i][kept], (h * 2)[kept])
        assert 0.3 < kept.float().mean() < 0.7
    masks = out != 0
    assert not torch.equal(masks[0], masks[1]), "identical members must get different masks"


# ------------------------------------------------------------------------------- member losses


def test_member_losses_give_each_member_its_own_gradient():
    members = _q2_members(3)
    stack = phalanx.stack(members)
    x, y = torch.randn(8, 10), torch.randint(0, 2, (8,))
    losses = phalanx.member_losses(F.cross_entropy, stack(x), y)
    assert losses.shape == (3,)
    losses.sum().backward()
    for i, m in enumerate(members):
        F.cross_entropy(m(x), y).backward()
        assert_close(losses[i], F.cross_entropy(m(x), y))
        assert_close(stack.module[0].weight.grad[i], m[0].weight.grad, msg=f"member {i}")


def test_member_losses_per_member_targets_and_errors():
    stack = phalanx.stack([nn.Linear(3, 1) for _ in range(4)])
    xs, ts = torch.randn(4, 5, 3), torch.randn(4, 5, 1)
    out = stack(xs, in_dims=0)
    losses = phalanx.member_losses(F.mse_loss, out, ts, in_dims=(0, 0))
    for i in range(4):
        assert_close(losses[i], F.mse_loss(out[i], ts[i]))
    with pytest.raises(
        ValueError,
        match=r"member axis included, but in_dims=\(0, None\) treats it "
        r"as shared.*pass in_dims=\(0, 0\)",
    ):
        phalanx.member_losses(F.mse_loss, out, ts)
    with pytest.raises(ValueError, match=r"must return one scalar per member.*reduction='mean'"):
        phalanx.member_losses(F.mse_loss, out, ts, in_dims=(0, 0), reduction="none")


def test_settings_outside_tensors_must_agree():
    # a Dropout's p is per member (tests/test_dropout_rates.py); a LeakyReLU's slope is not
    a = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.LeakyReLU(0.1))
    b = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.2), nn.LeakyReLU(0.3))
    with pytest.raises(
        ValueError,
        match=r"member 1 submodule '2' is LeakyReLU\(negative_slope=0.3\), member 0 has "
        r"LeakyReLU\(negative_slope=0.1\)",
    ):
        phalanx.stack([a, b])


def test_members_whose_configs_differ_are_refused_naming_each_field_and_both_values():
    # the message showed two configs cut to '{"activation_function":...' and no field
    tf = pytest.importorskip("transformers")

    def gpt2(**kw):
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16, **kw)
        )

    a, b = gpt2(layer_norm_epsilon=1e-5), gpt2(layer_norm_epsilon=1e-3, scale_attn_weights=False)
    with pytest.raises(ValueError) as info:
        phalanx.stack([a, b])
    message = str(info.value)
    assert re.search(
        r"member 1 the root module has config\.layer_norm_epsilon=0\.001 where member 0 has "
        r"1e-05; config\.scale_attn_weights=False where member 0 has True \(the same object, "
        r"held by \d+ more submodules, 'transformer', \.\.\.\)",
        message,
    ), message
    assert message.count("config.layer_norm_epsilon") == 1  # one config, named once
