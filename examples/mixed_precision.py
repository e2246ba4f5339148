"""Mixed precision with one loss scale per member: phalanx.MemberGradScaler.

One member overflowing (its loss is inf here) skips only its own step and halves only its
own scale; torch.amp.GradScaler would skip every member and halve the one shared scale.
"""

import torch
import torch.nn.functional as F
from torch import nn

import phalanx

torch.set_num_threads(1)
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.float16 if device == "cuda" else torch.bfloat16
stack = phalanx.stack(lambda: nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)),
                      num_members=4, seed=0).to(device)  # fmt: skip
opt = phalanx.optim.Adam(stack.parameters(), lr=1e-3)
scaler = phalanx.MemberGradScaler(4, device=device, init_scale=2.0**12)
for step in range(3):
    x, y = torch.randn(16, 10, device=device), torch.randint(0, 3, (16,), device=device)
    with torch.autocast(device, dtype=dtype):
        out = stack(x)
    losses = phalanx.member_losses(F.cross_entropy, out.float(), y)
    if step == 1:
        losses = losses * torch.tensor([1.0, 1.0, float("inf"), 1.0], device=device)
    opt.zero_grad()
    scaler.scale(losses).backward()  # each member's loss times its own scale, summed
    scaler.unscale_(opt)
    phalanx.clip_grad_norm_(stack.parameters(), 1.0)
    scaler.step(opt)  # the members whose gradients overflowed keep their weights and state
    scaler.update()
    print(
        f"step {step}: skipped {scaler.last_skipped.tolist()}, scales {scaler.get_scale().tolist()}"
    )
