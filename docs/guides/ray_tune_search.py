"""A Ray Tune searcher driven 8 configurations at a time, each batch one stack.

`phalanx.integrations.ray_tune.optimize` asks the searcher for configurations, trains them as
one stack with `train(configs)` (which returns one value per configuration) and tells the
searcher the results; Ray's runtime is not started. `train_step` is the stack's whole
training step, captured by `phalanx.compile_step` where that measures faster (`optimize`'s
`step="auto"`, the default). Needs `pip install 'phalanx[ray]'`.
Run: python docs/guides/ray_tune_search.py
"""

import optuna
import torch
import torch.nn.functional as F
from ray import tune
from ray.tune.search.optuna import OptunaSearch
from torch import nn

import phalanx
from phalanx.integrations.ray_tune import optimize, train_step

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
    step = train_step(stack, F.cross_entropy, opt)  # the step optimize(step=...) chooses
    for _ in range(30):
        losses = step(x, y)  # (N,), before this step's update
    return losses  # (N,): configuration i's value


space = OptunaSearch.convert_search_space({"lr": tune.loguniform(1e-4, 1e-1)})
searcher = OptunaSearch(space, metric="loss", mode="min", seed=0)
runs = optimize(searcher, train, n_trials=16, n_members=8)
trial_id, config, value = min(runs, key=lambda run: run[2])
print(f"{len(runs)} configurations; best {trial_id}: lr {config['lr']:.3g}, loss {value:.3f}")
