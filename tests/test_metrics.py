"""Per-member metrics: (N,) values equal to each member's own, a table and a plot."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from phalanx import metrics

N, B, C = 4, 16, 5


def test_loss_and_accuracy_equal_each_member_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(N, B, C)
    shared = torch.randint(0, C, (B,))
    own = torch.randint(0, C, (N, B))
    for targets, member_targets in ((shared, [shared] * N), (own, list(own))):
        loss = metrics.loss(F.cross_entropy, logits, targets)
        acc = metrics.accuracy(logits, targets)
        assert loss.shape == acc.shape == (N,) and not loss.requires_grad
        for i in range(N):
            torch.testing.assert_close(loss[i], F.cross_entropy(logits[i], member_targets[i]))
            expected = (logits[i].argmax(-1) == member_targets[i]).float().mean()
            assert acc[i] == expected
    perfect = F.one_hot(own, C).float()
    assert torch.equal(metrics.accuracy(perfect, own), torch.ones(N))


def test_loss_takes_any_torch_loss() -> None:
    pred, y = torch.randn(N, B, 3), torch.randn(B, 3)
    mse = metrics.loss(F.mse_loss, pred, y)
    torch.testing.assert_close(mse, ((pred - y) ** 2).mean(dim=(1, 2)))


def test_shape_errors_are_named() -> None:
    with pytest.raises(
        ValueError,
        match=r"metrics.accuracy\(\): shared targets must have shape \(B, ...\) with B = 16.*got \(7,\)",
    ):
        metrics.accuracy(torch.randn(N, B, C), torch.zeros(7, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"metrics.accuracy\(\): logits must have shape \(N, B, C\); got \(16, 5\)"
    ):
        metrics.accuracy(torch.randn(B, C), torch.zeros(B, dtype=torch.long))


def test_table_sorts_and_puts_nan_last() -> None:
    acc = torch.tensor([0.5, float("nan"), 0.9, 0.7])
    lr = torch.tensor([1e-3, 1e-2, 1e-1, 1.0])
    text = metrics.table({"lr": lr, "accuracy": acc}, sort_by="accuracy", top=3)
    lines = text.splitlines()
    assert lines[0].split() == ["member", "lr", "accuracy"]
    assert [line.split()[0] for line in lines[1:]] == ["2", "3", "0"]
    assert lines[1].split() == ["2", "0.1", "0.9"]
    text = metrics.table({"accuracy": acc}, sort_by="accuracy", descending=False)
    assert [line.split()[0] for line in text.splitlines()[1:]] == ["0", "3", "2", "1"]
    with pytest.raises(
        ValueError,
        match=r"table\(\): every column must have one value per member; got sizes \{'a': 4, 'b': 3\}",
    ):
        metrics.table({"a": acc, "b": acc[:3]})
    with pytest.raises(ValueError, match=r"sort_by='loss' is not a column"):
        metrics.table({"a": acc}, sort_by="loss")


def test_plot_writes_pngs(tmp_path) -> None:
    lr = torch.logspace(-4, 0, N)
    points = metrics.plot(torch.rand(N), tmp_path / "acc.png", x=lr, xlabel="lr", logx=True)
    curves = metrics.plot(torch.rand(20, N), tmp_path / "loss.png", x=lr, xlabel="lr", logx=True)
    plain = metrics.plot(torch.rand(20, N), tmp_path / "plain.png")
    for path in (points, curves, plain):
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(
        ValueError,
        match=r"plot\(\): values must be \(N,\) or \(T, N\) and x \(N,\); got values \(4,\) and x \(3,\)",
    ):
        metrics.plot(torch.rand(N), tmp_path / "bad.png", x=torch.ones(3))


def test_matplotlib_is_imported_only_when_plotting() -> None:
    code = "import sys, phalanx, phalanx.metrics; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
