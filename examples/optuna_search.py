"""An Optuna search in stacks: 24 trials on scikit-learn's digits, 12 asked at a time.

Each trial suggests a learning rate, a momentum and a width; the trials of one width share a
stack (the width is an architecture choice), trained with per-member hyperparameters and a
per-member data pipeline (each member its own order and its own random noise augmentation,
through torch's DataLoader). Optuna's MedianPruner stops members by mask; every trial is
told COMPLETE, PRUNED or FAIL. Each step runs captured by phalanx.compile_step where that
measures faster (optimize's step="auto"). Run: python examples/optuna_search.py
"""

import optuna
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import phalanx
import phalanx.integrations.optuna as po

torch.set_num_threads(1)
optuna.logging.set_verbosity(optuna.logging.WARNING)
digits = load_digits()
x, y = torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target)
train_set, (x_val, y_val) = TensorDataset(x[:1400], y[:1400]), (x[1400:], y[1400:])


def noise(item, generator):
    """Per-member augmentation: a member's own reproducible noise stream."""
    image, label = item
    return image + 0.05 * torch.randn(image.shape, generator=generator), label


def model(trial):
    trial.suggest_float("lr", 1e-3, 1.0, log=True)
    trial.suggest_float("momentum", 0.0, 0.95)
    width = trial.suggest_categorical("width", [32, 64])
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))


def train(group):
    p = group.params
    opt = phalanx.optim.SGD(group.stack.parameters(), lr=p["lr"], momentum=p["momentum"])
    loader = phalanx.data.MemberDataLoader(
        train_set, num_members=len(group), batch_size=64, transform=noise, seed=0
    )
    step = group.train_step(F.cross_entropy, opt, in_dims=0)  # captured where faster
    for epoch in range(4):
        for xb, yb in loader:
            step(xb, yb, mask=group.mask)  # pruned members stop stepping
        with torch.no_grad():
            val = phalanx.metrics.loss(F.cross_entropy, group.stack(x_val), y_val)
        group.report(val, epoch)  # each trial its own intermediate value; the pruner decides
    return val


study = optuna.create_study(
    sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=12),
    pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1),
)
groups = po.optimize(study, model, train, n_trials=24, n_members=12)
states = [t.state.name for t in study.trials]
print(
    f"{len(study.trials)} trials in {len(groups)} stacks (by width): "
    + ", ".join(f"{states.count(s)} {s}" for s in ("COMPLETE", "PRUNED", "FAIL"))
)
best = study.best_trial
print(f"best trial {best.number}: validation loss {best.value:.3f} with {best.params}")
print("steps:", sorted({str(g.step_choice) for g in groups}))
