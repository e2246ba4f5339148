"""A learning-rate sweep of 32 MLPs in one stack, each member early-stopped on its own
(newcomer task 2).

Every member gets its own learning rate (an (N,) tensor), its own order of the data, and its
own validation loss; a member whose validation loss has not improved for `patience` epochs
is masked out of the optimizer step, which leaves its weights and optimizer state exactly as
they were, while the others train on as if it did not exist. Run:
python docs/guides/sweep_early_stopping.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import phalanx

torch.manual_seed(0)
N, patience = 32, 2

x = torch.randn(1024, 16)
y = (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 0).long()  # 3 classes
x_train, y_train, x_val, y_val = x[:768], y[:768], x[768:], y[768:]

stack = phalanx.stack(
    lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3)), num_members=N, seed=0
)
lrs = torch.logspace(-4, 0.5, N)  # one learning rate per member, 1e-4 .. 3.2
opt = phalanx.optim.SGD(stack.parameters(), lr=lrs, momentum=0.9)
loader = phalanx.data.MemberLoader(x_train, y_train, num_members=N, batch_size=64, seed=0)

best = torch.full((N,), float("inf"))
since_best = torch.zeros(N, dtype=torch.long)
training = torch.ones(N, dtype=torch.bool)  # the members still training
for epoch in range(12):
    epochs_run = epoch + 1
    for xb, yb in loader:
        losses = phalanx.member_losses(F.cross_entropy, stack(xb, in_dims=0), yb, in_dims=(0, 0))
        opt.zero_grad()
        losses.sum().backward()
        opt.step(mask=training)  # masked members keep their weights and optimizer state
    with torch.no_grad():
        val = phalanx.metrics.loss(F.cross_entropy, stack(x_val), y_val)  # (N,)
    improved = val < best
    best = torch.where(improved, val, best)
    since_best = torch.where(improved, 0, since_best + 1)
    training &= since_best < patience
    if not training.any():
        break

winner = int(best.argmin())
print(f"{int((~training).sum())} of {N} members stopped early, in {epochs_run} epochs")
print(f"best member {winner}: lr {lrs[winner]:.3g}, validation loss {best[winner]:.3f}")
model = stack.unstack()[winner]  # an ordinary nn.Sequential with the member's weights
print("the winner as an ordinary module:", type(model).__name__, tuple(model(x_val).shape))
