"""Ensemble metrics against hand-written references, sample by sample and member by member."""

from __future__ import annotations

import math

import pytest
import torch

import phalanx
from helpers import assert_close

N, B, C = 4, 37, 5


@pytest.fixture
def data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits = torch.randn(N, B, C, dtype=torch.float64) * 3
    return logits, torch.randint(0, C, (B,))


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    e = [math.exp(v - top) for v in row]
    return [v / sum(e) for v in e]


def _mean_probs(logits: torch.Tensor) -> list[list[float]]:
    per = [[_softmax(logits[i, b].tolist()) for b in range(B)] for i in range(N)]
    return [[sum(per[i][b][c] for i in range(N)) / N for c in range(C)] for b in range(B)]


def _entropy(p: list[float]) -> float:
    return -sum(v * math.log(v) for v in p if v > 0)


def test_predictive_mean(data):
    logits, _ = data
    got = phalanx.metrics.predictive_mean(logits)
    assert_close(got, torch.tensor(_mean_probs(logits), dtype=torch.float64), dtype=torch.float64)


def test_nll_is_of_the_mean_prediction(data):
    logits, y = data
    p = _mean_probs(logits)
    expected = -sum(math.log(p[b][int(y[b])]) for b in range(B)) / B
    assert_close(phalanx.metrics.nll(logits, y), torch.tensor(expected, dtype=torch.float64),
                 dtype=torch.float64)  # fmt: skip
    members_mean = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.repeat(N))
    assert phalanx.metrics.nll(logits, y) < members_mean  # not the members' mean NLL


@pytest.mark.parametrize("bins", [1, 10])
def test_ece(data, bins):
    logits, y = data
    p = _mean_probs(logits)
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64).tolist()
    members = [[] for _ in range(bins)]
    for b in range(B):
        conf = max(p[b])
        k = next(k for k in range(bins) if conf <= edges[k + 1] or k == bins - 1)
        members[k].append((float(p[b].index(conf) == int(y[b])), conf))
    expected = sum(
        len(m) / B * abs(sum(a for a, _ in m) / len(m) - sum(c for _, c in m) / len(m))
        for m in members
        if m
    )
    got = phalanx.metrics.ece(logits, y, bins=bins)
    assert_close(got, torch.tensor(expected, dtype=torch.float64), dtype=torch.float64)


def test_disagreement(data):
    logits, _ = data
    pred = logits.argmax(-1).tolist()
    pairs = [(i, j) for i in range(N) for j in range(N) if i < j]
    expected = sum(sum(pred[i][b] != pred[j][b] for b in range(B)) / B for i, j in pairs)
    got = phalanx.metrics.disagreement(logits)
    assert_close(got, torch.tensor(expected / len(pairs), dtype=torch.float64), dtype=torch.float64)
    assert phalanx.metrics.disagreement(logits[:1].expand(N, B, C)) == 0


def test_mutual_information(data):
    logits, _ = data
    p = _mean_probs(logits)
    expected = [
        _entropy(p[b]) - sum(_entropy(_softmax(logits[i, b].tolist())) for i in range(N)) / N
        for b in range(B)
    ]
    got = phalanx.metrics.mutual_information(logits)
    assert_close(got, torch.tensor(expected, dtype=torch.float64), dtype=torch.float64)
    agreeing = phalanx.metrics.mutual_information(logits[:1].expand(N, B, C))
    assert_close(agreeing, torch.zeros(B, dtype=torch.float64), dtype=torch.float64)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"\(N, B, C\)"):
        phalanx.metrics.nll(torch.randn(B, C), torch.zeros(B, dtype=torch.long))
    with pytest.raises(ValueError, match=r"targets must be class indices of shape \(B,\)"):
        phalanx.metrics.ece(torch.randn(N, B, C), torch.zeros(N, B, dtype=torch.long))
