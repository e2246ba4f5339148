"""phalanx.integrations.torchrl with the real tensordict and TorchRL's SACLoss."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import phalanx

pytest.importorskip("tensordict")
pytest.importorskip("torchrl")
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torchrl.modules import ProbabilisticActor, TanhNormal
from torchrl.objectives import SACLoss

from phalanx.integrations.torchrl import TensorDictStack, loss_members, loss_stack

N, B = 5, 8


def critic():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = critic()

    def forward(self, obs, act):
        return self.net(torch.cat([obs, act], -1))


def test_tensordict_stack_declares_the_member_dim():
    critics = phalanx.stack(critic, num_members=N, seed=0)
    module = TensorDictStack(critics, in_keys=["obs_act"], out_keys=["q"])
    td = TensorDict({"obs_act": torch.randn(B, 6)}, batch_size=[B])
    out = module(td)
    assert out.batch_size == (N, B) and out.names == ["member", None]
    assert torch.equal(out["q"], critics(td["obs_act"]))
    assert out["obs_act"].stride(0) == 0  # the shared input is expanded, not copied
    assert td.batch_size == (B,) and "q" not in td
    # a [N, B] TensorDict with a "member" dim gives member i its own row
    x = torch.randn(N, B, 6)
    own = module(TensorDict({"obs_act": x}, batch_size=[N, B], names=["member", None]))
    assert torch.equal(own["q"], critics(x, in_dims=0))
    for i, m in enumerate(critics.unstack()):
        torch.testing.assert_close(own["q"][i], m(x[i]), rtol=0, atol=1e-6)


def test_tensordict_stack_errors_name_the_fix():
    critics = phalanx.stack(critic, num_members=N, seed=0)
    module = TensorDictStack(critics, in_keys=["obs_act"], out_keys=["q", "extra"])
    with pytest.raises(ValueError, match=r"returned 1 outputs for out_keys \['q', 'extra'\]"):
        module(TensorDict({"obs_act": torch.randn(B, 6)}, batch_size=[B]))
    wrong = TensorDict({"obs_act": torch.randn(3, B, 6)}, batch_size=[3, B], names=["member", None])
    with pytest.raises(ValueError, match=r"'member' dim has 3 entries but the stack has 5"):
        TensorDictStack(critics, ["obs_act"], ["q"])(wrong)
    with pytest.raises(TypeError, match=r"expected a phalanx\.Stack"):
        TensorDictStack(critic(), ["obs_act"], ["q"])


def sac(critics):
    actor_net = nn.Sequential(nn.Linear(4, 4), NormalParamExtractor())
    actor = ProbabilisticActor(
        TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
    )
    members = loss_members(critics, ["observation", "action"], ["state_action_value"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SACLoss(actor, members, num_qvalue_nets=N, target_entropy=-2.0)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "observation": torch.randn(B, 4, generator=g),
            "action": torch.rand(B, 2, generator=g) * 2 - 1,
            ("next", "observation"): torch.randn(B, 4, generator=g),
            ("next", "reward"): torch.randn(B, 1, generator=g),
            ("next", "done"): torch.zeros(B, 1, dtype=torch.bool),
            ("next", "terminated"): torch.zeros(B, 1, dtype=torch.bool),
        },
        [B],
    )


@pytest.mark.filterwarnings("ignore:No target network updater")
def test_sac_loss_trains_the_stacks_tensors_with_per_member_learning_rates():
    critics = phalanx.stack(Critic, num_members=N, seed=0, backend="loop")
    loss = sac(critics)
    stack = loss_stack(loss, "qvalue_network", backend="loop")
    params = dict(loss.qvalue_network_params.flatten_keys(".").items())
    for name, p in stack.named_parameters():
        assert p is params[name], name  # the same Parameter objects: one .grad
    for k, v in critics.state_dict().items():
        assert torch.equal(stack.state_dict()[k], v)  # the loss started from the members
    td = batch()
    q = stack(td["observation"], td["action"])
    assert q.shape == (N, B, 1)
    for i, m in enumerate(stack.unstack()):
        assert torch.equal(q[i], m(td["observation"], td["action"]))
    lrs = [1e-3, 1e-2, 1e-1, 1.0, 0.0]
    opt = phalanx.optim.SGD(stack.parameters(), lr=lrs)
    loss(td)["loss_qvalue"].backward()
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in stack.named_parameters()}
    opt.step()
    for n, p in stack.named_parameters():
        w, g = before[n]
        for i in range(N):
            ref = nn.Parameter(w[i].clone())
            ref.grad = g[i].clone()
            torch.optim.SGD([ref], lr=lrs[i]).step()
            assert torch.equal(p[i], ref), f"member {i} {n}"
    # the loss itself computes with the stepped tensors: member 4 (lr 0) is where it was
    assert torch.equal(
        loss.qvalue_network_params["module", "net", "0", "weight"][4],
        before["module.net.0.weight"][0][4],
    )


def test_loss_stack_refuses_a_network_without_members():
    loss = sac(phalanx.stack(Critic, num_members=N, seed=0))
    with pytest.raises(TypeError, match=r"no member dim.*num_qvalue_nets=N"):
        loss_stack(loss, "actor_network")
    with pytest.raises(TypeError, match="no TensorDictModule 'value_network'"):
        loss_stack(loss, "value_network")
