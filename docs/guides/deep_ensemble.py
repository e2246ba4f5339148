"""A deep ensemble of 8 small CNNs, each on its own bootstrap resample (newcomer task 1).

Each member draws its own bootstrap batches from one data set (`MemberLoader(bootstrap=True)`),
the stack trains all members in one call per step, and the ensemble's prediction is the mean
of the members' probabilities. Run: python docs/guides/deep_ensemble.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import phalanx

torch.manual_seed(0)
N = 8  # members

# A toy image task: 10 classes of 1x12x12 images, each class its own pattern plus noise.
patterns = torch.randn(10, 1, 12, 12)
labels = torch.randint(0, 10, (512,))
images = patterns[labels] + 2.0 * torch.randn(512, 1, 12, 12)
x_train, y_train, x_test, y_test = images[:384], labels[:384], images[384:], labels[384:]


def make_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 3 * 3, 10),
    )  # fmt: skip


# The factory form builds N members, member i seeded with seed + i.
stack = phalanx.stack(make_cnn, num_members=N, seed=0)
opt = phalanx.optim.Adam(stack.parameters(), lr=3e-3)
# Each member its own bootstrap resample, drawn in its own order: batches (N, 32, ...).
loader = phalanx.data.MemberLoader(
    x_train, y_train, num_members=N, batch_size=32, bootstrap=True, seed=0
)

for _ in range(3):
    for xb, yb in loader:  # xb (8, 32, 1, 12, 12), yb (8, 32)
        logits = stack(xb, in_dims=0)  # in_dims=0: member i reads xb[i]
        losses = phalanx.member_losses(F.cross_entropy, logits, yb, in_dims=(0, 0))
        opt.zero_grad()
        losses.sum().backward()  # the sum: each member gets exactly its own gradient
        opt.step()

stack.eval()  # BatchNorm's running statistics, kept per member
with torch.no_grad():
    logits = stack(x_test)  # a shared input: every member sees the test set, (8, 128, 10)
member_accuracy = phalanx.metrics.accuracy(logits, y_test)  # (8,)
ensemble = phalanx.metrics.predictive_mean(logits)  # (128, 10): the mean of the softmaxes
print("member accuracy:", " ".join(f"{a:.2f}" for a in member_accuracy.tolist()))
print(f"ensemble accuracy: {(ensemble.argmax(-1) == y_test).float().mean():.2f}")
print(f"ensemble NLL: {phalanx.metrics.nll(logits, y_test):.3f}")
