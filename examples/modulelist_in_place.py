"""A ModuleList inside a model, made parallel in place: the seed's 400 per-feature networks.

The model below is as people write it: an nn.ModuleList of 400 networks Linear(20, 10) ->
Linear(10, 1), a forward that loops over it, and a checkpoint saved with the list's keys.
phalanx.stack_in_place swaps the list for a stack: the loop still runs unchanged, the old
checkpoint still loads, model.heads(x) runs all 400 networks in one call, and the model's
state_dict keeps the list's keys, so the unstacked model loads what the stacked one saved.
Run: python examples/modulelist_in_place.py
"""

import io

import torch
from torch import nn

import phalanx

N, D, B = 400, 20, 32


class PerFeatureModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 10), nn.Linear(10, 1)) for _ in range(N)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 20 * 400) -> (B, 400)
        return torch.cat([h(x[:, D * i : D * (i + 1)]) for i, h in enumerate(self.heads)], dim=1)


torch.manual_seed(0)
model = PerFeatureModel()
x = torch.randn(B, D * N)
before = model(x)
checkpoint = io.BytesIO()
torch.save(model.state_dict(), checkpoint)  # written before stacking: keys heads.<i>.<name>

heads = phalanx.stack_in_place(model, "heads")  # model.heads is now a phalanx stack
assert torch.equal(model(x), before)  # the model's own loop runs unchanged
print(f"model.heads: {type(model.heads).__name__} of {len(model.heads)} members, backend "
      f"{heads.backend!r}; heads[3][0].weight {tuple(model.heads[3][0].weight.shape)}")  # fmt: skip

# The one call: every network at once, (N, B, 1), equal to the loop to float rounding.
y = phalanx.merge(model.heads(phalanx.split(x, N, dim=1), in_dims=0), dim=1)  # (32, 400)
torch.testing.assert_close(y, before)
print(f"one call for all {N} networks: output {tuple(y.shape)}, equals the loop")

# The old checkpoint loads into the stacked model; its state_dict has the list's keys.
checkpoint.seek(0)
result = model.load_state_dict(torch.load(checkpoint))
keys = list(model.state_dict())
print(f"old checkpoint loaded ({result}); state_dict keys {keys[:2]} ... {len(keys)} in all")

# Train all 400 at once.
target = torch.randn(B, N)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # built after stacking: the stacked leaves
for _step in range(50):
    out = model.heads(phalanx.split(x, N, dim=1), in_dims=0)  # (N, B, 1)
    losses = phalanx.member_losses(
        nn.functional.mse_loss, out, phalanx.split(target, N, dim=1), in_dims=(0, 0)
    )  # (N,)
    opt.zero_grad()
    losses.sum().backward()
    opt.step()
print(f"after 50 Adam steps: mean member loss {losses.mean().item():.4f}")

# What the stacked model saves loads into the model as it was, without phalanx.
plain = PerFeatureModel()
plain.load_state_dict(model.state_dict())
torch.testing.assert_close(plain(x), model(x))
print("the trained weights load into the unstacked model: outputs equal")
