"""A user's install: the wheel (and the git URL) into a fresh virtual environment with only
torch and phalanx's own dependencies, then the tour's core run there.

About a minute, most of it pip installing torch from its wheel; ``-m "not install"`` leaves it
out. pip reaches torch through the same index and find-links as ``make`` (constraints.txt pins
it), so the test needs no network beyond what ``make`` needs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.install, pytest.mark.timeout(600)]

# The tour's core, as a user runs it in the new environment; it prints where phalanx and
# torch came from, so the test can tell the wheel's copy from the source tree's.
TOUR = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from torch import nn
    import phalanx

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)) for _ in range(8)]
    stack = phalanx.stack(models)
    assert (len(stack), stack.backend) == (8, "fused"), (len(stack), stack.backend)
    x, y = torch.randn(32, 10), torch.randint(0, 2, (32,))
    assert stack(x).shape == (8, 32, 2)
    assert stack(torch.randn(8, 4, 10), in_dims=0).shape == (8, 4, 2)

    opt = phalanx.optim.Adam(stack.parameters(), lr=torch.logspace(-3, -1, 8))
    first = phalanx.member_losses(F.cross_entropy, stack(x), y)
    for _ in range(20):
        losses = phalanx.member_losses(F.cross_entropy, stack(x), y)
        opt.zero_grad(); losses.sum().backward(); opt.step()
    assert bool((losses < first).all()), (first, losses)

    # member 3 of the stack is member 3 trained alone
    for p, q in zip(stack.unstack()[3].parameters(), stack.parameters()):
        assert torch.equal(p, q[3])
    print("phalanx", phalanx.__version__, phalanx.__file__)
    print("torch", torch.__version__, torch.__file__)
    """
)


def _run(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, f"{' '.join(args)}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    # The user's environment, not the suite's: no PYTHONPATH pointing at the source tree.
    out = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    out["OMP_NUM_THREADS"] = "1"
    return out


def _tour(venv: Path, env: dict[str, str], tmp_path: Path) -> tuple[tuple[str, str], str]:
    """Runs the tour with the venv's Python; returns ((phalanx's version, its file), torch's
    version and file)."""
    script = tmp_path / "tour.py"
    script.write_text(TOUR)
    # run from an empty folder, so that no source tree is on the path
    done = subprocess.run(
        [str(venv / "bin" / "python"), str(script)],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    version, where = lines["phalanx"].split(" ", 1)
    return (version, where), lines["torch"]


def test_the_wheel_and_the_git_url_install_into_a_fresh_venv(tmp_path, env):
    wheels = tmp_path / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(ROOT)],
        env,
    )  # fmt: skip
    (wheel,) = wheels.glob("phalanx-*.whl")

    # A real fresh environment (no system site-packages): pip puts torch in it from its wheel.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q"]
    _run([*pip, "-c", str(ROOT / "constraints.txt"), str(wheel)], env)

    (version, where), torch_where = _tour(venv, env, tmp_path)
    site = str(venv / "lib")
    assert where.startswith(site), where  # phalanx from the wheel, not from src/
    assert torch_where.split()[-1].startswith(site), torch_where  # torch installed in the venv
    assert version == _source_version()
    info = _run([str(venv / "bin" / "python"), "-m", "phalanx"], env)
    assert info.startswith(f"phalanx {_source_version()} ")
    assert "pip install ./tools" in info  # the tools are not in the wheel

    # The git URL: pip clones the repository at HEAD and builds it (the committed tree).
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the git URL route cannot be tried")
    head = _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], env).strip()
    _run([*pip, "--no-deps", "--force-reinstall", f"git+file://{ROOT}@{head}"], env)
    (_, where), _ = _tour(venv, env, tmp_path)
    assert where.startswith(site), where


def _source_version() -> str:
    text = (ROOT / "src" / "phalanx" / "__init__.py").read_text()
    return text.split('__version__ = "', 1)[1].split('"', 1)[0]
