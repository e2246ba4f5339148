"""Ensemble metrics: what the N members say together, from the stack's logits ``(N, B, C)``.

The predictive distribution of a deep ensemble is the mean of the members' softmax outputs;
its NLL and calibration error, the members' disagreement and the mutual information between
the prediction and the member (the ensemble's epistemic uncertainty) are read off it. Every
function takes logits (the stack's output) and works in log space where it can.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _logits(fn: str, logits: Tensor) -> Tensor:
    if logits.dim() != 3:
        raise ValueError(
            f"{fn}: logits must have shape (N, B, C), members first as a stack returns them; "
            f"got {tuple(logits.shape)}."
        )
    return logits.detach()


def _labels(fn: str, targets: Tensor, batch: int) -> Tensor:
    if targets.shape != (batch,):
        raise ValueError(
            f"{fn}: targets must be class indices of shape (B,) = ({batch},), one per sample "
            f"of the ensemble's prediction; got {tuple(targets.shape)}."
        )
    return targets


def _log_mean_probs(logits: Tensor) -> Tensor:
    """log of the mean over members of softmax(logits): (B, C)."""
    n = logits.shape[0]
    return torch.logsumexp(logits.log_softmax(-1), dim=0) - math.log(n)


def predictive_mean(logits: Tensor) -> Tensor:
    """The ensemble's predictive distribution: the members' softmax averaged, ``(B, C)``.

    Example:
        >>> predictive_mean(torch.tensor([[[0.0, 0.0]], [[0.0, 100.0]]]))
        tensor([[0.2500, 0.7500]])
    """
    return _log_mean_probs(_logits("phalanx.metrics.predictive_mean()", logits)).exp()


def nll(logits: Tensor, targets: Tensor) -> Tensor:
    """Negative log-likelihood of the predictive mean, averaged over the batch (a scalar).

    Not the members' mean NLL: ``-log mean_i p_i(y)``, computed with a log-sum-exp.

    Args:
        logits: ``(N, B, C)``.
        targets: ``(B,)`` class indices.
    """
    fn = "phalanx.metrics.nll()"
    log_p = _log_mean_probs(_logits(fn, logits))
    y = _labels(fn, targets, log_p.shape[0])
    return -log_p.gather(1, y[:, None]).mean()


def ece(logits: Tensor, targets: Tensor, *, bins: int = 15) -> Tensor:
    """Expected calibration error of the predictive mean (a scalar in ``[0, 1]``).

    Samples are binned by the confidence of the ensemble's prediction (its largest mean
    probability) into ``bins`` equal-width bins of ``(0, 1]``; the ECE is the bins' mean
    ``|accuracy - confidence|`` weighted by how many samples each holds.
    """
    fn = "phalanx.metrics.ece()"
    probs = _log_mean_probs(_logits(fn, logits)).exp()
    y = _labels(fn, targets, probs.shape[0])
    confidence, predicted = probs.max(dim=1)
    correct = (predicted == y).to(probs.dtype)
    edges = torch.linspace(0, 1, bins + 1, dtype=probs.dtype, device=probs.device)
    which = torch.bucketize(confidence, edges[1:-1], right=False)  # bin b holds (e_b, e_b+1]
    count = torch.zeros(bins, dtype=probs.dtype, device=probs.device)
    count.index_add_(0, which, torch.ones_like(confidence))
    gap = torch.zeros_like(count).index_add_(0, which, correct - confidence)
    return gap.abs().sum() / confidence.numel()


def disagreement(logits: Tensor) -> Tensor:
    """How often two members predict different classes: the mean over the pairs of members
    of the fraction of samples their arg-max classes differ on (a scalar in ``[0, 1]``)."""
    fn = "phalanx.metrics.disagreement()"
    predicted = _logits(fn, logits).argmax(-1)  # (N, B)
    n = predicted.shape[0]
    if n < 2:
        raise ValueError(f"{fn}: disagreement needs at least 2 members; got {n}.")
    differ = (predicted[:, None, :] != predicted[None, :, :]).to(logits.dtype).mean(-1)
    return differ.sum() / (n * (n - 1))  # the diagonal is 0


def mutual_information(logits: Tensor) -> Tensor:
    """Per sample, the mutual information between the prediction and the member, ``(B,)``.

    ``H[mean_i p_i] - mean_i H[p_i]`` in nats (BALD's epistemic uncertainty): zero where the
    members agree, large where each is confident and they disagree.
    """
    logits = _logits("phalanx.metrics.mutual_information()", logits)
    log_p = logits.log_softmax(-1)  # (N, B, C)
    log_mean = _log_mean_probs(logits)  # (B, C)
    total = -(log_mean.exp() * log_mean).sum(-1)
    members = -(log_p.exp() * log_p).sum(-1).mean(0)
    return (total - members).clamp_min(0)
