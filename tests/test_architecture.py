"""The shape of the code: what is in the wheel, which way the imports run, one seam for torch
internals, a small named surface on Stack, and checkpoints that hold no torch internals."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import phalanx

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "phalanx"


def _modules(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def test_the_import_contract_holds_and_can_fail(tmp_path):
    """`lint-imports` (run by `make lint`) keeps the layers one way; shown to fail on an
    upward import."""
    exe = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout
    # The same contracts on a copy of the library with one upward import added must break.
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "phalanx", copy / "phalanx")
    shutil.copytree(ROOT / "tools" / "src" / "phalanx_tools", copy / "phalanx_tools")
    leaf = copy / "phalanx" / "_members.py"
    leaf.write_text(leaf.read_text() + "\n\ndef _up():\n    from phalanx.core import _stack\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    env = {"PYTHONPATH": str(copy), "PATH": str(exe.parent)}
    broken = subprocess.run([exe], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert broken.returncode != 0
    assert "phalanx._members is not allowed to import phalanx.core" in broken.stdout


def test_the_wheel_holds_only_the_library(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("phalanx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert all(n.startswith(("phalanx/", "phalanx-")) for n in names), names
    assert not any("_bench" in n or "_demo" in n or "zoo" in n for n in names), names
    assert "phalanx/testing.py" in names
    assert "phalanx/py.typed" in names  # PEP 561: the annotations reach users' type checkers


# torch's private attributes read on objects other than the ``torch`` module itself: a
# module's slot and hook dicts, a tensor's internals, DTensor's parts.
_TORCH_PRIVATE_ATTRIBUTES = {
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
    "_version", "_base", "_cdata", "_is_view", "_typed_storage", "_local_tensor", "_spec",
}  # fmt: skip


def _private_torch_uses(path: Path) -> list[str]:
    """torch names starting with an underscore used in ``path``'s code (not its strings):
    through ``torch`` itself, through a name bound to a part of torch (``_aten =
    torch.ops.aten``, ``import torch.nn.functional as F``, ``from torch import nn``), and
    torch's private attributes of modules and tensors (``mod._parameters``, ``t._version``)."""
    tree = ast.parse(path.read_text())
    torch_names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names |= {a.asname for a in node.names if a.asname and a.name.startswith("torch")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            torch_names |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):  # names bound to torch.<...> (one level of aliasing is enough)
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, base = node.targets[0], node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            named = isinstance(target, ast.Name) and isinstance(base, ast.Name)
            if named and base.id in torch_names:
                torch_names.add(target.id)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            private = [a.name for a in node.names if a.name.startswith("_")]
            if any(part.startswith("_") for part in node.module.split(".")) or private:
                found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__"):
                continue
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in torch_names:
                found.append(f"{path.name}:{node.lineno} {base.id}...{node.attr}")
            elif node.attr in _TORCH_PRIVATE_ATTRIBUTES:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    return found


def test_the_seam_check_sees_aliases_and_private_attributes(tmp_path):
    """The check below finds what it was blind to: an alias of a torch namespace, a module's
    slot dict, a tensor's version counter."""
    code = tmp_path / "leak.py"
    code.write_text(
        "import torch\n"
        "from torch import nn\n"
        "_aten = torch.ops.aten\n"
        "op = _aten._unsafe_view.default\n"
        "hooks = nn.modules.module._global_forward_hooks\n"
        "def f(mod, t):\n"
        "    return mod._parameters, t._version\n"
    )
    found = sorted(f.split(" ", 1)[1] for f in _private_torch_uses(code))
    assert found == [
        "._parameters",
        "._version",
        "_aten..._unsafe_view",
        "nn..._global_forward_hooks",
    ]


def test_private_torch_apis_go_through_the_one_seam():
    uses = [
        u for p in _modules(SRC) if p.name != "_torch_compat.py" for u in _private_torch_uses(p)
    ]
    assert uses == []
    assert ".".join(torch.__version__.split(".")[:2]) == phalanx._torch_compat.CHECKED_ON


def test_the_declared_torch_range_starts_at_the_tested_release():
    text = (ROOT / "pyproject.toml").read_text()
    constraint = (ROOT / "constraints.txt").read_text()
    assert '"torch>=2.13"' in text and "torch==2.13.0" in constraint


_STACK_PRIVATE = {
    "_template", "_requested", "_view", "_param_slots", "_buffer_slots", "_retired",
    "_stacked_state", "_from_stacked",
}  # fmt: skip


def test_only_the_stack_reads_its_private_parts():
    """Consumers use Stack's named surface (from_stacked, stacked_state, template,
    requested_backend, retire, retired), not its private attributes."""
    readers = []
    for path in [*_modules(SRC), *_modules(ROOT / "tools" / "src"), *_modules(ROOT / "tests")]:
        if path.name == "_stack.py" or path == Path(__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in _STACK_PRIVATE:
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert readers == []


def test_a_warning_points_at_the_users_line():
    """phalanx's warnings name the caller's line, however deep inside phalanx they start."""
    stack = phalanx.stack([nn.Linear(3, 2) for _ in range(2)])
    with pytest.warns(DeprecationWarning) as caught:
        phalanx.metrics.loss(
            stack(torch.randn(4, 3)), torch.randn(4, 2), torch.nn.functional.mse_loss
        )
    assert caught[0].filename == __file__


def test_checkpoints_store_no_torch_internals_and_load_another_torchs_keys(tmp_path):
    """What torch's own load_state_dict accepts, phalanx.load accepts: a scheduler state with a
    private key another torch release adds and one it drops, a torch optimizer's group without
    a key an older release did not have. The files hold no pytree treespec."""
    stack = phalanx.stack([nn.Linear(3, 2) for _ in range(2)])
    opt = torch.optim.Adam(stack.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    stack(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    path = tmp_path / "run.safetensors"
    phalanx.save(path, stack, optimizer=opt, scheduler=sched)
    pdir = tmp_path / "sharded"
    phalanx.distributed.save(pdir, stack, optimizer=opt, scheduler=sched)
    assert "treespec" not in (pdir / "index.json").read_text()

    # Rewrite the single file's JSON as another torch release would have written it.
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert "treespec" not in metadata["phalanx"]
    blob = json.loads(metadata["phalanx"])
    blob["scheduler"].pop("_is_initial")
    blob["scheduler"]["_a_key_of_another_torch"] = 1
    group = blob["optimizer"]["param_groups"][0]
    group.pop("decoupled_weight_decay")
    metadata["phalanx"] = json.dumps(blob)
    save_file(tensors, str(path), metadata)

    fresh = phalanx.stack([nn.Linear(3, 2) for _ in range(2)])
    opt2 = torch.optim.Adam(fresh.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        phalanx.load(path, fresh, optimizer=opt2, scheduler=sched2)
    assert sched2.last_epoch == 1
    assert torch.equal(fresh.module.weight, stack.module.weight)
