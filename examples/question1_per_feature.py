"""Question 1: 400 independent networks Linear(20, 10) -> Linear(10, 1), one per input slice.

Input x is (32, 20 * 400); network i reads columns 20 i .. 20 i + 20; output (32, 400).
Run: python examples/question1_per_feature.py
"""

import torch
from torch import nn

import phalanx

N, D, B = 400, 20, 32
models = nn.ModuleList(nn.Sequential(nn.Linear(D, 10), nn.Linear(10, 1)) for _ in range(N))
stack = phalanx.stack(models)

x = torch.randn(B, D * N)
y = phalanx.merge(stack(phalanx.split(x, N, dim=1), in_dims=0), dim=1)  # (32, 400)

# The loop it replaces, for comparison.
expected = torch.cat([m(x[:, D * i : D * (i + 1)]) for i, m in enumerate(models)], dim=1)
torch.testing.assert_close(y, expected)
print(f"output {tuple(y.shape)} from {N} networks on backend {stack.backend!r}; equals the loop")

# Training all 400 at once: phalanx.compile_step captures forward, per-member losses,
# backward and the Adam step as one computation (it keeps the eager step where that measures
# faster, and says which in step.report). The eager loop body it replaces:
#     losses = phalanx.member_losses(F.mse_loss, stack(xs, in_dims=0), ts, in_dims=(0, 0))
#     opt.zero_grad(); losses.sum().backward(); opt.step()
target = torch.randn(B, N)
opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
step = phalanx.compile_step(stack, nn.functional.mse_loss, opt, in_dims=0)
xs, ts = phalanx.split(x, N, dim=1), phalanx.split(target, N, dim=1)  # (N, B, 20), (N, B, 1)
for _step in range(100):
    losses = step(xs, ts)  # (N,)
print(f"after 100 Adam steps: mean member loss {losses.mean().item():.4f}")
print(f"training step: {step.report}")
stack.copy_to(models)  # the ModuleList now holds the trained weights
