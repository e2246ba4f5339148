"""The README's promises: the examples and the demo run and print what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx_tools.cli import main

ROOT = Path(__file__).resolve().parents[1]


def needs(*modules):
    """Skips an integration's example where its tool is not installed (the dev extra has it)."""
    from importlib.util import find_spec

    missing = [m for m in modules if find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {missing}")


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("question1_per_feature.py", r"output \(32, 400\) from 400 networks .*equals the loop"),
        ("question2_ensemble.py", r"member 3 as an ordinary module gives the stack's output"),
        ("modulelist_in_place.py", r"(?s)old checkpoint loaded .*load into the unstacked model"),
        (
            "hf_trainer.py",
            r"(?s)per-member losses: ([0-9.]+ ){7}[0-9.]+\n.*holds the trained member 3's weights: True",
        ),
        (
            "accelerate_loop.py",
            r"norms before clipping: ([0-9.]+ ){3}[0-9.e+]+\neach member clipped",
        ),
        (
            "mixed_precision.py",
            r"step 1: skipped \[False, False, True, False\], scales \[4096.0, 4096.0, 2048.0, 4096.0\]",
        ),
        pytest.param(
            "lightning_ensemble.py",
            r"(?s)members still training: \[(\d, ){7}\d\].*load_from_checkpoint: same weights and mask: True",
            marks=needs("pytorch_lightning"),
        ),
        pytest.param(
            "loggers_per_member.py",
            r"(?s)TensorBoard runs: \['member_00', .*'member_03'\].*W&B offline runs: 4.*"
            r"MLflow child runs: \[\('stack-member_0', '0.01'\)",
            marks=needs("tensorboard", "wandb", "mlflow"),
        ),
        pytest.param(
            "torchrl_critics.py",
            r"(?s)TensorDictStack: \(5, 64\) \['member', None\] \(5, 64, 1\).*per-critic mean Q",
            marks=needs("torchrl", "tensordict"),
        ),
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
    argv += ["--compile-backend", "aot_eager"]  # compile_step's capture without inductor's C++
    assert main([*argv, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    # 4 learning rates 0.01, 0.464, 21.5, 1000: the two largest overflow and are frozen
    assert re.search(r"Best 3 of 8 members by validation accuracy:\n +member +lr +seed", out), out
    assert re.search(r"Diverged: 4 of 8 members .* frozen \(lr 21\.5 and up\)", out), out
    ensemble = re.search(r"Ensemble of the top 3 \(mean of softmax\): test accuracy ([0-9.]+)", out)
    assert ensemble and float(ensemble[1]) > 0.5, f"chance is 0.1; 2 epochs learn more: {out}"
    assert re.search(r"loop over nn\.Modules.*EXTRAPOLATED from 2 members", out), out
    assert re.search(r"training step: compile_step, (captured|eager): eager step", out), out
    assert re.search(r"\(a\) one shared batch stream: .*\n +\(b\) own bootstrap batches: ", out)
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), "the plot is not a PNG"


def test_demo_rejects_a_grid_that_does_not_divide(capsys):
    assert main(["demo", "--members", "10", "--seeds", "4"]) == 2
    assert "--members 10 must be a multiple of --seeds 4" in capsys.readouterr().err
