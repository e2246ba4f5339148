"""An Optuna search run 16 trials at a time in one stack (newcomer task 6).

`model(trial)` suggests the hyperparameters and returns the trial's network; `train(group)`
trains one stack whose member i is trial i, with the trials' hyperparameters as (N,) tensors
(`group.params["lr"]`), and reports per-trial values to Optuna's pruner. `group.train_step`
is the whole training step, captured by `phalanx.compile_step` where that measures faster
(`optimize(..., step="auto")`, the default; "eager" or "captured" to choose). Trials that share an
architecture share a stack: suggest architecture choices (a width) from a few categories. A
dropout rate is a per-member value, as a learning rate is: any float keeps one stack.
Needs `pip install 'phalanx[optuna]'`. Run: python docs/guides/optuna_search.py
"""

import optuna
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
import phalanx.integrations.optuna as po

optuna.logging.set_verbosity(optuna.logging.WARNING)
torch.manual_seed(0)
x = torch.randn(768, 16)
y = (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 0).long()
x_train, y_train, x_val, y_val = x[:512], y[:512], x[512:], y[512:]


def model(trial):
    trial.suggest_float("lr", 1e-3, 1.0, log=True)  # a per-member value: any float
    trial.suggest_float("momentum", 0.0, 0.95)
    width = trial.suggest_categorical("width", [32, 64])  # an architecture: splits stacks
    p = trial.suggest_float("dropout", 0.0, 0.3)  # a per-member rate: keeps one stack
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Dropout(p), nn.Linear(width, 3))


def train(group):
    p = group.params  # {"lr": (N,), "momentum": (N,), "width": ...}: one value per trial
    opt = phalanx.optim.SGD(group.stack.parameters(), lr=p["lr"], momentum=p["momentum"])
    loader = group.loader(x_train, y_train, batch_size=64)  # trial i's own data order
    step = group.train_step(F.cross_entropy, opt, in_dims=0)  # per-member batches
    for epoch in range(4):
        for xb, yb in loader:
            step(xb, yb, mask=group.mask)  # pruned trials stop stepping
        group.stack.eval()
        with torch.no_grad():
            val = phalanx.metrics.loss(F.cross_entropy, group.stack(x_val), y_val)  # (N,)
        group.stack.train()
        group.report(val, epoch)  # each trial its own intermediate value; the pruner decides
    return val


study = optuna.create_study(
    sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=16),
    pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1),
)
groups = po.optimize(study, model, train, n_trials=32, n_members=16, progress=False)
states = [t.state.name for t in study.trials]
print(
    f"{len(study.trials)} trials in {len(groups)} stacks:",
    {s: states.count(s) for s in set(states)},
)
print(f"best trial {study.best_trial.number}: {study.best_value:.3f} with {study.best_params}")
print("steps:", sorted({g.step_choice for g in groups}))  # "captured" where it was faster
