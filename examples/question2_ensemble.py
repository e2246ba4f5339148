"""Question 2: train 8 networks Linear(10, 20) -> ReLU -> Linear(20, 2) with cross-entropy,
(a) every network on the same minibatch of 32, (b) every network on its own minibatch of 4.

Run: python examples/question2_ensemble.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import phalanx

N = 8
torch.manual_seed(0)
models = [nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)) for _ in range(N)]
stack = phalanx.stack(models)
opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
# compile_step captures the whole step (forward, per-member losses, backward, Adam) as one
# computation; it times it against the eager step and keeps the faster (step.report says).
# The eager loop body it runs:
#     losses = phalanx.member_losses(F.cross_entropy, stack(x), y)  # (8,)
#     opt.zero_grad(); losses.sum().backward(); opt.step()
shared = phalanx.compile_step(stack, F.cross_entropy, opt)

# A toy problem: the class is the sign of the first feature.
for _step in range(200):
    # (a) shared minibatch: x (32, 10) -> out (8, 32, 2)
    x = torch.randn(32, 10)
    y = (x[:, 0] > 0).long()
    losses = shared(x, y)  # (8,): each member gets exactly its own gradient
print("(a) shared minibatches, loss per member:", [round(v, 3) for v in losses.tolist()])
print(f"    training step: {shared.report}")

own = phalanx.compile_step(stack, F.cross_entropy, opt, in_dims=0)  # inputs and targets (N, ...)
for _step in range(200):
    # (b) per-member minibatches: xs (8, 4, 10) -> out (8, 4, 2)
    xs = torch.randn(N, 4, 10)
    ys = (xs[..., 0] > 0).long()  # (8, 4)
    losses = own(xs, ys)
print("(b) per-member minibatches, loss per member:", [round(v, 3) for v in losses.tolist()])
print(f"    training step: {own.report}")

trained = stack.unstack()  # 8 ordinary nn.Sequential modules with the trained weights
x = torch.randn(5, 10)
torch.testing.assert_close(trained[3](x), stack(x)[3])
print("unstack(): member 3 as an ordinary module gives the stack's output")
