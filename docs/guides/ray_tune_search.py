"""A Ray Tune searcher driven 8 configurations at a time, each batch one stack.

`phalanx.integrations.ray_tune.optimize` asks the searcher for configurations, trains them as
one stack with `train(configs)` (which returns one value per configuration) and tells the
searcher the results; Ray's runtime is not started. Needs `pip install 'phalanx[ray]'`.
Run: python docs/guides/ray_tune_search.py
"""

import optuna
import torch
import torch.nn.functional as F
from ray import tune
from ray.tune.search.optuna import OptunaSearch
from torch import nn

import phalanx
from phalanx.integrations.ray_tune import optimize

optuna.logging.set_verbosity(optuna.logging.WARNING)
torch.manual_seed(0)
x = torch.randn(512, 16)
y = (x[:, :4].sum(1) > 0).long()


def train(configs):
    stack = phalanx.stack(
        lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)),
        num_members=len(configs),
        seed=0,
    )
    opt = phalanx.optim.Adam(stack.parameters(), lr=[c["lr"] for c in configs])
    for _ in range(30):
        losses = phalanx.member_losses(F.cross_entropy, stack(x), y)
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
    return losses.detach()  # (N,): configuration i's value


space = OptunaSearch.convert_search_space({"lr": tune.loguniform(1e-4, 1e-1)})
searcher = OptunaSearch(space, metric="loss", mode="min", seed=0)
runs = optimize(searcher, train, n_trials=16, n_members=8)
trial_id, config, value = min(runs, key=lambda run: run[2])
print(f"{len(runs)} configurations; best {trial_id}: lr {config['lr']:.3g}, loss {value:.3f}")
