"""The README's promises: the examples and the demo run and print what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx_tools.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("question1_per_feature.py", r"output \(32, 400\) from 400 networks .*equals the loop"),
        ("question2_ensemble.py", r"member 3 as an ordinary module gives the stack's output"),
        ("modulelist_in_place.py", r"(?s)old checkpoint loaded .*load into the unstacked model"),
        (
            "optuna_search.py",
            r"24 trials in [2-9] stacks \(by width\): \d+ COMPLETE, [1-9]\d* PRUNED, 0 FAIL\n"
            r"best trial \d+: validation loss 0\.\d+",
        ),
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


def test_demo_trains_and_reports_accuracy(capsys, tmp_path):
    plot = tmp_path / "sweep.png"
    argv = ["demo", "--members", "8", "--seeds", "2", "--epochs", "2", "--hidden", "16"]
    argv += ["--lr-min", "0.01", "--lr-max", "1e3", "--top-k", "3", "--loop-members", "2"]
    argv += ["--threads", "1"]  # tiny ops: a second thread only waits on a busy machine
    assert main([*argv, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    # 4 learning rates 0.01, 0.464, 21.5, 1000: the two largest overflow and are frozen
    assert re.search(r"Best 3 of 8 members by validation accuracy:\n +member +lr +seed", out), out
    assert re.search(r"Diverged: 4 of 8 members .* frozen \(lr 21\.5 and up\)", out), out
    ensemble = re.search(r"Ensemble of the top 3 \(mean of softmax\): test accuracy ([0-9.]+)", out)
    assert ensemble and float(ensemble[1]) > 0.5, f"chance is 0.1; 2 epochs learn more: {out}"
    assert re.search(r"loop over nn\.Modules.*EXTRAPOLATED from 2 members", out), out
    assert re.search(r"\(a\) one shared batch stream: .*\n +\(b\) own bootstrap batches: ", out)
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), "the plot is not a PNG"


def test_demo_rejects_a_grid_that_does_not_divide(capsys):
    assert main(["demo", "--members", "10", "--seeds", "4"]) == 2
    assert "--members 10 must be a multiple of --seeds 4" in capsys.readouterr().err
