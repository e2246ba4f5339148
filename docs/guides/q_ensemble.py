"""A Q-ensemble with a target subset (REDQ): 10 critics, each target computed from a random 2
of the 10 target critics, and a soft target update for all of them in one call
(newcomer task 4). Run: python docs/guides/q_ensemble.py
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import phalanx

torch.manual_seed(0)
S, A, N, B, gamma = 8, 2, 10, 64, 0.99


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(S + A, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
        )

    def forward(self, obs, act):
        return self.net(torch.cat([obs, act], -1))


critics = phalanx.stack(Critic, num_members=N, seed=0)
targets = copy.deepcopy(critics)  # the target critics: a stack of their own
opt = phalanx.optim.Adam(critics.parameters(), lr=3e-4)

# A replay buffer of random transitions and a fixed policy, for the sake of the example.
buffer = {k: torch.randn(4096, n) for k, n in (("obs", S), ("act", A), ("next_obs", S))}
buffer["reward"], buffer["done"] = torch.randn(4096, 1), torch.zeros(4096, 1)


def policy(obs):
    return torch.tanh(obs[:, :A])


for _ in range(100):
    rows = torch.randint(0, 4096, (B,))
    obs, act, nobs, rew, done = (
        buffer[k][rows] for k in ("obs", "act", "next_obs", "reward", "done")
    )
    with torch.no_grad():
        subset = torch.randperm(N)[:2]  # REDQ: 2 of the 10 target critics
        q_next = targets(nobs, policy(nobs), subset=subset)  # (2, B, 1): only those 2 run
        y = rew + gamma * (1 - done) * q_next.min(0).values  # (B, 1): one target for all
    q = critics(obs, act)  # (10, B, 1): a shared batch, every critic
    losses = phalanx.member_losses(F.mse_loss, q, y)  # (10,): y is shared by every member
    opt.zero_grad()
    losses.sum().backward()
    opt.step()
    phalanx.polyak_(targets, critics, 0.005)  # every target critic, one call
print("per-critic TD loss:", " ".join(f"{v:.3f}" for v in losses.tolist()))
print("target critics moved towards the critics:", not torch.equal(targets(obs, act), q))
