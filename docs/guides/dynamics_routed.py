"""Model-based RL: 5 bootstrapped probabilistic dynamics models, then trajectory sampling with
each particle routed to its own member (newcomer task 3; PETS' TS1).

Training: each member its own bootstrap batches and a Gaussian negative log-likelihood.
Planning: `stack(obs, act, members=index)` sends row r to member `index[r]` and returns the
rows in the input's order, in one call. Run: python docs/guides/dynamics_routed.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import phalanx

torch.manual_seed(0)
S, A, N = 6, 2, 5  # state size, action size, members

obs, act = torch.randn(2048, S), torch.randn(2048, A)
mixing = torch.randn(S + A, S)
nxt = obs + 0.1 * torch.tanh(torch.cat([obs, act], 1) @ mixing) + 0.01 * torch.randn(2048, S)


class GaussianDynamics(nn.Module):
    """Predicts the state change's mean and log-variance, the log-variance softly bounded."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(S + A, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 2 * S)
        )
        self.max_logvar = nn.Parameter(torch.full((S,), 0.5))
        self.min_logvar = nn.Parameter(torch.full((S,), -5.0))

    def forward(self, o, a):
        mean, logvar = self.net(torch.cat([o, a], -1)).chunk(2, -1)
        logvar = self.max_logvar - F.softplus(self.max_logvar - logvar)
        logvar = self.min_logvar + F.softplus(logvar - self.min_logvar)
        return mean, logvar


def gaussian_nll(output, delta):
    """One member's loss on its own output (a tuple) and target."""
    mean, logvar = output
    return 0.5 * (logvar + (delta - mean) ** 2 * (-logvar).exp()).mean()


stack = phalanx.stack(GaussianDynamics, num_members=N, seed=0)
opt = phalanx.optim.Adam(stack.parameters(), lr=1e-3, weight_decay=1e-5)
loader = phalanx.data.MemberLoader(obs, act, nxt, num_members=N, batch_size=64, bootstrap=True)
for _ in range(2):
    for o, a, o2 in loader:  # (5, 64, 6), (5, 64, 2), (5, 64, 6): each member its own rows
        out = stack(o, a, in_dims=0)  # in_dims=0 marks every positional input per member
        losses = phalanx.member_losses(gaussian_nll, out, o2 - o, in_dims=(0, 0))
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
print("per-member NLL:", " ".join(f"{v:.3f}" for v in losses.tolist()))

# Trajectory sampling: 400 particles, each propagated by a member of its own.
particles = 400
state, actions = obs[:particles], torch.randn(10, particles, A)  # a 10-step action plan
member = torch.randint(0, N, (particles,))  # particle p uses member member[p]
with torch.no_grad():
    for a in actions:
        mean, logvar = stack(state, a, members=member)  # (400, 6) each, rows in input order
        state = state + mean + (0.5 * logvar).exp() * torch.randn_like(mean)
print("final particle states", tuple(state.shape))

# The routed call equals each member run alone on its own rows.
members = stack.unstack()
with torch.no_grad():
    routed, _ = stack(obs[:8], act[:8], members=member[:8])
    alone = torch.cat(
        [members[m](obs[r : r + 1], act[r : r + 1])[0] for r, m in enumerate(member[:8].tolist())]
    )
print("routed call equals each member alone:", torch.allclose(routed, alone, atol=1e-6))
