"""One small network per input feature: 400 networks read their own 20 columns of one wide
input (DESIGN question 1; a neural additive model has this shape).

`phalanx.split` turns the wide input (B, N * d) into (N, B, d) without copying, the stack runs
all 400 networks in one call, and `phalanx.merge` puts the outputs side by side again.
Run: python docs/guides/per_feature.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import phalanx

torch.manual_seed(0)
N, d = 400, 20

models = nn.ModuleList(nn.Sequential(nn.Linear(d, 10), nn.Linear(10, 1)) for _ in range(N))
stack = phalanx.stack(models)  # the ModuleList is left untouched
x = torch.randn(32, d * N)  # network i reads columns d*i .. d*i + d

xs = phalanx.split(x, N, dim=1)  # (400, 32, 20): a view of x
y = phalanx.merge(stack(xs, in_dims=0), dim=1)  # (400, 32, 1) -> (32, 400)
print("output", tuple(y.shape), "from", len(stack), "networks, backend", stack.backend)

# The loop it replaces, for comparison: the same numbers, to float rounding.
loop = torch.cat([m(x[:, d * i : d * i + d]) for i, m in enumerate(models)], dim=1)
print("equals the loop:", torch.allclose(y, loop, atol=1e-6))

# Training: an additive model fits the sum of the per-feature outputs to a target.
target = torch.sin(x[:, ::d]).sum(1, keepdim=True)  # depends on one column per feature
opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
for _ in range(50):
    y = phalanx.merge(stack(phalanx.split(x, N, dim=1), in_dims=0), dim=1)
    loss = F.mse_loss(y.sum(1, keepdim=True), target)  # one model: the networks are coupled
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"additive model loss after 50 steps: {loss.item():.3f}")
