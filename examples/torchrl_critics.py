"""A stack of five critics as a TensorDict module ([N, B] out, a declared "member" dim), and
the same critics inside TorchRL's SACLoss, trained with one learning rate per critic."""

import warnings

import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.modules import ProbabilisticActor, TanhNormal
from torchrl.objectives import SACLoss

import phalanx
from phalanx.integrations.torchrl import TensorDictStack, loss_members, loss_stack

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
N, B = 5, 64


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, obs, act):
        return self.net(torch.cat([obs, act], -1))


critics = phalanx.stack(Critic, num_members=N, seed=0)
batch = TensorDict(
    {
        "observation": torch.randn(B, 4),
        "action": torch.rand(B, 2) * 2 - 1,
        ("next", "observation"): torch.randn(B, 4),
        ("next", "reward"): torch.randn(B, 1),
        ("next", "done"): torch.zeros(B, 1, dtype=torch.bool),
        ("next", "terminated"): torch.zeros(B, 1, dtype=torch.bool),
    },
    [B],
)
q = TensorDictStack(critics, in_keys=["observation", "action"], out_keys=["q"])(batch)
print("TensorDictStack:", tuple(q.batch_size), q.names, tuple(q["q"].shape))

actor = ProbabilisticActor(
    TensorDictModule(
        nn.Sequential(nn.Linear(4, 4), NormalParamExtractor()),
        in_keys=["observation"],
        out_keys=["loc", "scale"],
    ),
    in_keys=["loc", "scale"],
    distribution_class=TanhNormal,
)
loss = SACLoss(
    actor,
    loss_members(critics, ["observation", "action"], ["state_action_value"]),
    num_qvalue_nets=N,
    target_entropy=-2.0,
)
shared = loss_stack(loss, "qvalue_network")  # the loss's own critic tensors, as a stack
critic_opt = phalanx.optim.Adam(shared.parameters(), lr=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2])
actor_opt = torch.optim.Adam(loss.actor_network_params.values(True, True), lr=3e-4)
for _ in range(20):
    out = loss(batch)
    critic_opt.zero_grad()
    actor_opt.zero_grad()
    (out["loss_qvalue"] + out["loss_actor"]).backward()
    phalanx.clip_grad_norm_(shared.parameters(), max_norm=1.0)  # each critic its own norm
    critic_opt.step()
    actor_opt.step()
td_q = shared(batch["observation"], batch["action"]).squeeze(-1)  # (N, B)
print("per-critic mean Q after 20 SAC steps:", [round(v, 3) for v in td_q.mean(1).tolist()])
