"""An accelerate training loop over a stack: `PhalanxAccelerator.clip_grad_norm_` clips each
member by its own norm, so one member's exploding gradient leaves the others' steps alone.
Needs `pip install 'phalanx[hf]'`. Run: python docs/guides/hf_accelerate.py
"""

import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.integrations.accelerate import PhalanxAccelerator

accelerator = PhalanxAccelerator(cpu=True)
stack = phalanx.stack(
    lambda: nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)), num_members=4, seed=0
)
opt = phalanx.optim.Adam(stack.parameters(), lr=[1e-3, 3e-3, 1e-2, 3e-2])
stack, opt = accelerator.prepare(stack, opt)
blowup = torch.tensor([1.0, 1.0, 1.0, 1e4])  # member 3's loss, and so its gradient, explodes
for _ in range(5):
    x, y = torch.randn(16, 10), torch.randint(0, 3, (16,))
    losses = phalanx.member_losses(F.cross_entropy, stack(x), y) * blowup
    accelerator.backward(losses)  # the (N,) losses: their sum is backpropagated
    norms = accelerator.clip_grad_norm_(stack.parameters(), 1.0)  # (N,): one norm per member
    opt.step()
    opt.zero_grad()
print("gradient norms before clipping:", " ".join(f"{v:.3g}" for v in norms.tolist()))
accelerator.save_state(tempfile.mkdtemp())
print("saved with accelerator.save_state")

# The whole step as one call, captured by phalanx.compile_step where that measures faster
# (one process, no fp16 scaler, no accumulation; elsewhere the eager step above, said why)
train = accelerator.train_step(stack, F.cross_entropy, opt, max_norm=1.0)  # step="auto"
for _ in range(12):
    x, y = torch.randn(16, 10), torch.randint(0, 3, (16,))
    losses = train(x, y)  # (N,), each member clipped by its own norm, member_mask applied
print("train_step runs the", train.choice, "step")
