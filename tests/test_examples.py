"""The README's promises: the examples and the demo run and print what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx._cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("question1_per_feature.py", r"output \(32, 400\) from 400 networks .*equals the loop"),
        ("question2_ensemble.py", r"member 3 as an ordinary module gives the stack's output"),
    ],
)
def test_example_runs(script, expected):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(expected, result.stdout), result.stdout


def test_demo_trains_and_reports_accuracy(capsys):
    assert main(["demo", "--members", "3", "--epochs", "2", "--hidden", "16"]) == 0
    out = capsys.readouterr().out
    accuracies = [float(a) for a in re.findall(r"ensemble \(mean of softmax\) ([0-9.]+)", out)]
    assert len(accuracies) == 2, out
    assert all(a > 0.5 for a in accuracies), f"digits should be learnt in 2 epochs: {out}"
