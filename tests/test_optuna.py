"""phalanx.integrations.optuna: N Optuna trials as one stack give the trial-by-trial results."""

from __future__ import annotations

import io
import math
import sys
import warnings

import optuna
import pytest
import torch
import torch.nn.functional as F
from optuna.trial import TrialState
from torch import nn

import phalanx
import phalanx.integrations.optuna as po
from helpers import PROGRESS_CASES, Terminal
from phalanx.testing import rounding_problems

optuna.logging.set_verbosity(optuna.logging.WARNING)

SEED, EPOCHS = 7, 3
_g = torch.Generator().manual_seed(0)
X = torch.randn(96, 6, generator=_g)
Y = X[:, :3].argmax(1)
XV = torch.randn(64, 6, generator=_g)
YV = XV[:, :3].argmax(1)


def model(trial):
    trial.suggest_float("lr", 1e-3, 0.3, log=True)
    trial.suggest_float("weight_decay", 1e-5, 1e-1, log=True)
    trial.suggest_categorical("batch_size", [16, 32])
    hidden = trial.suggest_categorical("hidden", [8, 12])
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def train(group):
    """Trains a group as one stack: per-member lr and weight decay, pruned members masked."""
    p = group.params
    opt = phalanx.optim.AdamW(group.stack.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])
    loader = group.loader(X, Y, batch_size=p["batch_size"][0])
    for epoch in range(EPOCHS):
        for xb, yb in loader:
            out = group.stack(xb, in_dims=0)
            losses = phalanx.member_losses(F.cross_entropy, out, yb, in_dims=(0, 0))
            opt.zero_grad()
            losses.sum().backward()
            opt.step(mask=group.live)
        with torch.no_grad():
            val = phalanx.metrics.loss(F.cross_entropy, group.stack(XV), YV)
        group.report(val, epoch)
    return val


def one_trial(dtype):
    """Optuna's own trial-by-trial objective: a plain module and torch.optim.AdamW."""

    def objective(trial):
        torch.manual_seed(SEED + trial.number)
        net = model(trial).to(dtype)
        p = trial.params
        opt = torch.optim.AdamW(net.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])
        loader = phalanx.data.MemberLoader(
            X, Y, num_members=1, batch_size=p["batch_size"], first_member=trial.number, seed=SEED
        )
        for epoch in range(EPOCHS):
            for xb, yb in loader:
                loss = F.cross_entropy(net(xb[0].to(dtype)), yb[0])
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                val = float(F.cross_entropy(net(XV.to(dtype)), YV))
            trial.report(val, epoch)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return val

    return objective


def _study(**kwargs):
    return optuna.create_study(
        sampler=optuna.samplers.RandomSampler(seed=3),
        pruner=optuna.pruners.ThresholdPruner(upper=1.0, n_warmup_steps=1),
        **kwargs,
    )


def test_a_search_in_stacks_equals_optuna_trial_by_trial():
    n = 24
    stacked = _study()
    groups = po.optimize(
        stacked, model, train, n_trials=n, n_members=12, group_by=["batch_size"], seed=SEED
    )
    refs = {}
    for dtype in (torch.float32, torch.float64):
        refs[dtype] = _study()
        refs[dtype].optimize(one_trial(dtype), n_trials=n)
    got, ref32, ref64 = stacked.trials, refs[torch.float32].trials, refs[torch.float64].trials
    # The architecture (hidden) and the batch size split each batch of 12 into stacks.
    assert len(groups) > 2
    assert all(len({t.params["hidden"] for t in g.trials}) == 1 for g in groups)
    assert [t.params for t in got] == [t.params for t in ref32]
    states = [t.state for t in got]
    assert states == [t.state for t in ref32] == [t.state for t in ref64]
    assert TrialState.PRUNED in states and TrialState.COMPLETE in states
    for a, b, c in zip(got, ref32, ref64):
        steps = sorted(a.intermediate_values)
        assert steps == sorted(b.intermediate_values)
        curve = [torch.tensor([t.intermediate_values[s] for s in steps]) for t in (a, b, c)]
        assert not rounding_problems(*curve, what=f"trial {a.number}'s curve")
    done = [i for i, s in enumerate(states) if s is TrialState.COMPLETE]
    values = [torch.tensor([t[i].value for i in done]) for t in (got, ref32, ref64)]
    assert not rounding_problems(*values, what="the completed trials' values")
    assert stacked.best_trial.number == refs[torch.float64].best_trial.number


def test_a_median_pruner_and_tpe_prune_and_complete_members():
    study = optuna.create_study(
        sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=8),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=0),
    )
    po.optimize(study, model, train, n_trials=32, n_members=16, group_by=["batch_size"], seed=SEED)
    states = [t.state for t in study.trials]
    assert len(states) == 32 and TrialState.RUNNING not in states
    assert states.count(TrialState.PRUNED) > 0 and states.count(TrialState.COMPLETE) > 0
    # a pruned trial got no more reports after the pruner stopped it
    for t in study.trials:
        if t.state is TrialState.PRUNED:
            assert len(t.intermediate_values) < EPOCHS


def test_keep_live_drops_pruned_members_and_trains_the_rest_as_before():
    def train_keep(group):
        p = group.params
        opt = phalanx.optim.AdamW(
            group.stack.parameters(), lr=p["lr"], weight_decay=p["weight_decay"]
        )
        loader = group.loader(X, Y, batch_size=p["batch_size"][0])
        stack = group.stack
        for epoch in range(EPOCHS):
            for xb, yb in loader:
                losses = phalanx.member_losses(
                    F.cross_entropy, stack(xb, in_dims=0), yb, in_dims=(0, 0)
                )
                opt.zero_grad()
                losses.sum().backward()
                opt.step()
            with torch.no_grad():
                val = phalanx.metrics.loss(F.cross_entropy, stack(XV), YV)
            group.report(val, epoch)
            if not group.live.any():
                break
            stack = group.keep_live(stack, optimizer=opt, loader=loader)
        return val if len(val) == len(group) else torch.full((len(group),), math.nan)

    masked, kept = _study(), _study()
    po.optimize(masked, model, train, n_trials=16, group_by=["batch_size"], seed=SEED)
    po.optimize(kept, model, train_keep, n_trials=16, group_by=["batch_size"], seed=SEED)
    assert [t.state for t in masked.trials] == [t.state for t in kept.trials]
    for a, b in zip(masked.trials, kept.trials):
        assert a.intermediate_values == pytest.approx(b.intermediate_values, rel=1e-5)
        if a.state is TrialState.COMPLETE:
            assert a.value == pytest.approx(b.value, rel=1e-5)


def test_a_non_finite_member_fails_alone_and_the_others_complete():
    def train_nan(group):
        val = torch.arange(len(group), dtype=torch.float32)
        val[1] = math.nan
        group.report(val, 0)
        val[2] = math.inf  # finite when reported, not at the end
        return val

    study = optuna.create_study()
    po.optimize(study, lambda t: nn.Linear(2, 2), train_nan, n_trials=4)
    last = study.trials
    assert [t.state for t in last] == [
        TrialState.COMPLETE,
        TrialState.FAIL,
        TrialState.FAIL,
        TrialState.COMPLETE,
    ]
    assert last[0].value == 0.0 and last[3].value == 3.0
    assert last[1].intermediate_values == {}  # a nan is never reported


def test_a_study_resumed_from_its_storage_continues(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    first = optuna.create_study(
        study_name="s",
        storage=url,
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.NopPruner(),
    )
    po.optimize(first, model, train, n_trials=8, group_by=["batch_size"], seed=SEED)
    del first
    resumed = optuna.load_study(
        study_name="s",
        storage=url,
        sampler=optuna.samplers.TPESampler(seed=1),
        pruner=optuna.pruners.NopPruner(),
    )
    groups = po.optimize(resumed, model, train, n_trials=8, group_by=["batch_size"], seed=SEED)
    numbers = [t.number for g in groups for t in g.trials]
    assert sorted(numbers) == list(range(8, 16))
    assert len(resumed.trials) == 16
    assert all(t.state is not TrialState.RUNNING for t in resumed.trials)
    # a resumed trial k trains what trial k trains in a fresh study of the same seed
    trial = resumed.trials[9]
    alone = optuna.create_study(pruner=optuna.pruners.NopPruner())
    for _ in range(10):
        alone.enqueue_trial(trial.params)
    po.optimize(alone, model, train, n_trials=10, seed=SEED)
    assert alone.trials[9].value == pytest.approx(trial.value, rel=1e-5)


def test_an_exception_in_train_fails_every_untold_trial_and_propagates():
    def broken(group):
        raise RuntimeError("out of memory")

    study = optuna.create_study()
    with pytest.raises(RuntimeError, match="out of memory"):
        po.optimize(study, model, broken, n_trials=6, group_by=["batch_size", "hidden"])
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 6


def test_bad_results_and_arguments_are_refused():
    def too_many(group):
        return torch.zeros(len(group) + 1)

    with pytest.raises(ValueError, match=r"expected one value per member \(3\); got 4"):
        po.optimize(optuna.create_study(), lambda t: nn.Linear(2, 2), too_many, n_trials=3)
    with pytest.raises(ValueError, match="n_members must be a positive int; got 0"):
        po.optimize(optuna.create_study(), model, train, n_trials=3, n_members=0)
    with pytest.raises(
        TypeError, match=r"must suggest the trial's values and return its nn.Module"
    ):
        po.optimize(optuna.create_study(), lambda t: 3, train, n_trials=3)


def test_params_missing_in_some_trials_name_them():
    def conditional(trial):
        if trial.number % 2:
            trial.suggest_float("momentum", 0.0, 0.9)
        return nn.Linear(2, 2)

    def use(group):
        return torch.tensor(group.params["momentum"])

    with pytest.raises(KeyError, match=r"trials \[0, 2\] did not suggest 'momentum'"):
        po.optimize(optuna.create_study(), conditional, use, n_trials=4)


def test_a_continuous_dropout_search_stays_one_stack():
    def dropout_model(trial):
        trial.suggest_float("lr", 1e-3, 0.3, log=True)
        p = trial.suggest_float("dropout", 0.0, 0.5)  # every trial its own rate
        return nn.Sequential(nn.Linear(6, 8), nn.Dropout(p), nn.Linear(8, 3))

    rates = []

    def quick(group):
        rates.append((group.stack.dropout_rates["1"].tolist(), group.params["dropout"]))
        return torch.zeros(len(group))

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", po.StackSplitWarning)
        groups = po.optimize(study, dropout_model, quick, n_trials=8)
    assert len(groups) == 1 and len(groups[0]) == 8
    assert rates[0][0] == pytest.approx(rates[0][1], abs=0)  # member i has trial i's rate


def test_a_batch_that_falls_apart_into_stacks_of_one_says_why():
    def alpha_model(trial):
        trial.suggest_float("lr", 1e-3, 0.3, log=True)
        p = trial.suggest_float("dropout", 0.0, 0.5)  # an AlphaDropout's rate is a setting
        return nn.Sequential(nn.Linear(6, 8), nn.AlphaDropout(p), nn.Linear(8, 3))

    def quick(group):
        return torch.zeros(len(group))

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    match = (
        r"(?s)8 trials made 8 stacks \(8 of one member\).*AlphaDropout\(p=.*"
        r"suggest_categorical"
    )
    with pytest.warns(po.StackSplitWarning, match=match):
        groups = po.optimize(study, alpha_model, quick, n_trials=8)
    assert len(groups) == 8
    # a few stacks, one per value of a categorical width: what was asked, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", po.StackSplitWarning)
        po.optimize(_study(), model, quick, n_trials=12)


@pytest.mark.parametrize(("terminal", "progress", "shown"), PROGRESS_CASES)
def test_the_progress_bar_shows_on_a_terminal_or_as_progress_says(
    monkeypatch, terminal, progress, shown
):
    stderr = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    po.optimize(
        study, lambda t: nn.Linear(2, 2), lambda g: torch.zeros(len(g)), n_trials=4,
        n_members=2, progress=progress,
    )  # fmt: skip
    assert ("optuna trials: 100%" in stderr.getvalue() and "4/4" in stderr.getvalue()) is shown
    assert bool(stderr.getvalue()) is shown
    with pytest.raises(TypeError, match="progress must be True, False or None; got 'yes'"):
        po.optimize(study, model, train, n_trials=1, progress="yes")


def _lr_model(trial):
    trial.suggest_float("lr", 0.0, 1.0)
    return nn.Linear(2, 1)


def _zeros(group):
    return torch.zeros(len(group.trials))


@pytest.mark.parametrize(
    ("n_trials", "n_members", "told"), [(2, 2, 2), (5, 2, 2), (3, 1, 2), (5, 3, 3)]
)
def test_a_grid_sampler_that_stops_the_study_ends_the_search(n_trials, n_members, told):
    grid = optuna.samplers.GridSampler({"lr": [0.1, 0.2]})
    study = optuna.create_study(sampler=grid)
    groups = po.optimize(study, _lr_model, _zeros, n_trials=n_trials, n_members=n_members)
    # the batch running when the grid ran out finishes; no batch is asked after it
    assert sum(len(g) for g in groups) == told == len(study.trials)
    assert all(t.state is TrialState.COMPLETE for t in study.trials)
    assert {t.params["lr"] for t in study.trials} == {0.1, 0.2}
    study.optimize(lambda t: t.suggest_float("lr", 0.0, 1.0), n_trials=1)  # optuna's own loop
    assert len(study.trials) == told + 1


def test_multi_objective_studies_and_unknown_group_by_names_are_refused():
    study = optuna.create_study(directions=["minimize", "maximize"])
    with pytest.raises(ValueError, match=r"2 objectives.*single-objective"):
        po.optimize(study, _lr_model, _zeros, n_trials=2)
    assert not study.trials
    study = optuna.create_study()
    with pytest.raises(ValueError, match=r"group_by names \['batch'\], which no trial suggested"):
        po.optimize(study, _lr_model, _zeros, n_trials=2, group_by=("lr", "batch"))
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 2


def train_step_search(dtype):
    """``train`` through ``group.train_step``: per-member batches, pruned members dropped by
    ``keep_live`` (the step follows the smaller stack), at ``dtype``."""

    def train_with_step(group):
        group.stack.to(dtype)
        p = group.params
        opt = phalanx.optim.AdamW(
            group.stack.parameters(), lr=p["lr"], weight_decay=p["weight_decay"]
        )
        loader = group.loader(X.to(dtype), Y, batch_size=p["batch_size"][0])
        step = group.train_step(F.cross_entropy, opt, in_dims=0, backend="aot_eager")
        for epoch in range(EPOCHS):
            for xb, yb in loader:
                step(xb, yb, mask=group.mask)
            with torch.no_grad():
                val = phalanx.metrics.loss(F.cross_entropy, group.stack(XV.to(dtype)), YV)
            group.report(val, epoch)
            if not group.live.any():
                break
            group.keep_live(group.stack, optimizer=opt, loader=loader)
        return val if len(val) == len(group) else torch.full((len(group),), math.nan)

    return train_with_step


def nan_model(trial):
    net = model(trial)
    if trial.number == 2:  # this trial diverged: NaN from the start, it fails alone
        with torch.no_grad():
            net[0].weight[0, 0] = math.nan
    return net


def test_a_search_with_the_captured_step_gives_the_eager_searchs_trials():
    runs = {}
    for step, dtype in (("eager", torch.float64), ("eager", torch.float32), ("captured", None)):
        study = _study()
        groups = po.optimize(
            study, nan_model, train_step_search(dtype or torch.float32), n_trials=12,
            n_members=12, group_by=["batch_size"], seed=SEED, step=step,
        )  # fmt: skip
        assert all(g.step == step and g.step_choice == step for g in groups)
        runs[step, dtype] = study.trials
    got, ref32, ref64 = (
        runs["captured", None],
        runs["eager", torch.float32],
        runs["eager", torch.float64],
    )
    states = [t.state for t in got]
    assert states == [t.state for t in ref32] == [t.state for t in ref64]
    assert states[2] is TrialState.FAIL and TrialState.COMPLETE in states
    for a, b, c in zip(got, ref32, ref64):
        steps = sorted(a.intermediate_values)
        assert steps == sorted(b.intermediate_values)
        if steps:  # the diverged trial reported none (a NaN fails it at once)
            curve = [torch.tensor([t.intermediate_values[s] for s in steps]) for t in (a, b, c)]
            assert not rounding_problems(*curve, what=f"trial {a.number}'s curve")


def test_the_progress_bar_says_which_step_ran(monkeypatch):
    stderr = Terminal()
    monkeypatch.setattr(sys, "stderr", stderr)
    po.optimize(
        _study(), model, train_step_search(torch.float32), n_trials=2, group_by=["batch_size"],
        seed=SEED, step="eager", progress=True,
    )  # fmt: skip
    assert "step=eager" in stderr.getvalue()
    with pytest.raises(ValueError, match=r"step must be 'auto'.*got 'fast'"):
        po.optimize(_study(), model, train, n_trials=1, step="fast")
