"""phalanx.integrations.ray_tune: a Tune searcher driven ask/tell, each batch one stack
(without Ray's runtime: no ray.init)."""

from __future__ import annotations

import copy
import io
import math
import sys

import optuna
import pytest
import torch
import torch.nn.functional as F
from ray import tune
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch
from torch import nn

import phalanx
from helpers import PROGRESS_CASES, Terminal
from phalanx.integrations.ray_tune import optimize, train_step
from phalanx.testing import assert_equal_to_loop

optuna.logging.set_verbosity(optuna.logging.WARNING)
_g = torch.Generator().manual_seed(0)
X = torch.randn(64, 5, generator=_g)
Y = X[:, :2].argmax(1)
SPACE = OptunaSearch.convert_search_space(
    {"lr": tune.loguniform(1e-3, 0.5), "momentum": tune.uniform(0.0, 0.9)}
)


def _nets(n, dtype=torch.float32):
    """n copies of one initialisation: the configurations differ in lr and momentum only."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)
    return [copy.deepcopy(net) for _ in range(n)]


def train(configs):
    stack = phalanx.stack(_nets(len(configs)))
    opt = phalanx.optim.SGD(
        stack.parameters(),
        lr=[c["lr"] for c in configs],
        momentum=[c["momentum"] for c in configs],
    )
    for _ in range(5):
        losses = phalanx.member_losses(F.cross_entropy, stack(X), Y)
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
    with torch.no_grad():
        return phalanx.metrics.loss(F.cross_entropy, stack(X), Y)


def alone(config, dtype):
    (net,) = _nets(1, dtype)
    opt = torch.optim.SGD(net.parameters(), lr=config["lr"], momentum=config["momentum"])
    for _ in range(5):
        loss = F.cross_entropy(net(X.to(dtype)), Y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(F.cross_entropy(net(X.to(dtype)), Y))


def _searcher(seed=0):
    return OptunaSearch(
        SPACE, metric="loss", mode="min", sampler=optuna.samplers.RandomSampler(seed=seed)
    )


def test_a_searcher_in_stacks_gives_the_configs_and_values_of_trial_by_trial():
    runs = optimize(_searcher(), train, n_trials=12, n_members=6)
    one_by_one = _searcher()
    configs = []
    for k in range(12):
        config = one_by_one.suggest(f"t{k}")
        one_by_one.on_trial_complete(f"t{k}", {"loss": alone(config, torch.float32)})
        configs.append(config)
    assert [c for _, c, _ in runs] == configs
    got = torch.tensor([v for _, _, v in runs])
    loop32 = torch.tensor([alone(c, torch.float32) for c in configs])
    loop64 = torch.tensor([alone(c, torch.float64) for c in configs])
    assert_equal_to_loop(got, loop32, loop64, what="the searcher's values")


def test_the_searcher_is_told_every_value_and_errors_for_non_finite():
    class Recording(Searcher):
        def __init__(self):
            super().__init__(metric="loss", mode="min")
            self.asked, self.told = [], []

        def suggest(self, trial_id):
            self.asked.append(trial_id)
            return {"lr": len(self.asked) * 0.1}

        def on_trial_complete(self, trial_id, result=None, error=False):
            self.told.append((trial_id, result, error))

    def values(configs):
        out = torch.tensor([c["lr"] for c in configs])
        out[1] = math.nan
        return out

    rec = Recording()
    runs = optimize(rec, values, n_trials=5, n_members=3)
    assert rec.asked == [f"phalanx_{k}" for k in range(5)]
    assert [t[0] for t in rec.told] == rec.asked
    assert rec.told[0] == ("phalanx_0", {"loss": pytest.approx(0.1)}, False)
    assert rec.told[1] == ("phalanx_1", None, True)  # nan: an error
    assert [t[2] for t in rec.told] == [False, True, False, False, True]  # member 1 of each batch
    assert [v for _, _, v in runs][3] == pytest.approx(0.4) and len(runs) == 5


def test_a_tpe_searcher_uses_the_told_values():
    searcher = OptunaSearch(SPACE, metric="loss", mode="min", seed=0)
    runs = optimize(searcher, train, n_trials=24, n_members=8)
    values = [v for _, _, v in runs]
    assert min(values[16:]) <= sorted(values[:8])[1]  # later rounds search near the best


def test_bad_calls_are_refused():
    with pytest.raises(ValueError, match="n_members must be a positive int; got 0"):
        optimize(_searcher(), train, n_trials=4, n_members=0)
    with pytest.raises(ValueError, match=r"returned 3 values for 4 configurations"):
        optimize(_searcher(), lambda c: [0.0] * 3, n_trials=4)
    with pytest.raises(ValueError, match="the searcher has no metric"):
        optimize(OptunaSearch(SPACE), train, n_trials=2)


@pytest.mark.parametrize(("terminal", "progress", "shown"), PROGRESS_CASES)
def test_the_progress_bar_shows_on_a_terminal_or_as_progress_says(
    monkeypatch, terminal, progress, shown
):
    stderr = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    optimize(_searcher(), lambda c: [0.0] * len(c), n_trials=4, n_members=2, progress=progress)
    assert ("tune trials: 100%" in stderr.getvalue() and "4/4" in stderr.getvalue()) is shown
    assert bool(stderr.getvalue()) is shown


def test_a_metric_other_than_the_searchers_is_refused():
    searcher = _searcher()
    with pytest.raises(ValueError, match=r"metric='acc' but the searcher optimizes 'loss'"):
        optimize(searcher, train, n_trials=2, metric="acc")
    assert len(optimize(searcher, train, n_trials=2, metric="loss")) == 2
    assert len(optimize(OptunaSearch(SPACE, mode="min"), train, n_trials=2)) == 2


def train_with_step(dtype):
    def run(configs):
        stack = phalanx.stack(_nets(len(configs), dtype))
        opt = phalanx.optim.SGD(
            stack.parameters(),
            lr=[c["lr"] for c in configs],
            momentum=[c["momentum"] for c in configs],
        )
        if len(configs) > 1:
            with torch.no_grad():
                stack.module[0].weight[1, 0, 0] = math.nan  # configuration 1 diverged
        step = train_step(stack, F.cross_entropy, opt, backend="aot_eager")  # optimize's step=
        for _ in range(6):
            step(X.to(dtype), Y)
        assert step.choice == step.mode
        with torch.no_grad():
            return phalanx.metrics.loss(F.cross_entropy, stack(X.to(dtype)), Y)

    return run


def test_a_search_with_the_captured_step_gives_the_eager_searchs_values(monkeypatch):
    stderr = Terminal()
    monkeypatch.setattr(sys, "stderr", stderr)
    runs = {}
    for step, dtype in (("eager", torch.float64), ("eager", torch.float32), ("captured", None)):
        runs[step, dtype] = optimize(
            _searcher(), train_with_step(dtype or torch.float32), n_trials=8, n_members=4,
            step=step, progress=True,
        )  # fmt: skip
        assert f"step={step}" in stderr.getvalue()
    got, ref32, ref64 = (
        runs["captured", None],
        runs["eager", torch.float32],
        runs["eager", torch.float64],
    )
    assert [c for _, c, _ in got] == [c for _, c, _ in ref32] == [c for _, c, _ in ref64]
    values = [torch.tensor([v for _, _, v in r]) for r in (got, ref32, ref64)]
    assert values[0][[1, 5]].isnan().all()  # the diverged ones, told as errors
    finite = values[1].isfinite()
    assert_equal_to_loop(values[0][finite], values[1][finite], values[2][finite])
    with pytest.raises(ValueError, match=r"step must be 'auto'.*got 'fast'"):
        optimize(_searcher(), train, n_trials=1, step="fast")
