"""The ecosystem's conventions: a warning class for every warning, ``__all__`` as the public
surface, a lazy ``import phalanx``, one version, a licence, ``python -m phalanx``."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import tomllib

import phalanx
from phalanx import _warnings

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "phalanx"

# The modules a user imports by name; phalanx's other packages are its internal layers.
PUBLIC = [
    "phalanx",
    "phalanx.data",
    "phalanx.distributed",
    "phalanx.metrics",
    "phalanx.optim",
    "phalanx.population",
    "phalanx.routing",
    "phalanx.testing",
    "phalanx.integrations",
]
INTEGRATIONS = {  # module -> the tool it needs
    "phalanx.integrations.accelerate": "accelerate",
    "phalanx.integrations.lightning": "pytorch_lightning",
    "phalanx.integrations.loggers": "tensorboard",
    "phalanx.integrations.optuna": "optuna",
    "phalanx.integrations.ray_tune": "ray",
    "phalanx.integrations.torchrl": "torchrl",
    "phalanx.integrations.transformers": "transformers",
}
INTERNAL = {"backends", "checkpoint", "core", "routed", "step", "train"}


# ---------------------------------------------------------------------------------- warnings


def _warn_calls(path: Path) -> list[tuple[int, ast.Call]]:
    tree = ast.parse(path.read_text())
    return [
        (node.lineno, node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id == "warn")
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "warn")
        )
    ]


def _phalanx_warning_problems(paths: list[Path]) -> list[str]:
    """Every warning call outside ``_warnings.py`` is ``warn(message, Category)`` with a
    category that is a PhalanxWarning subclass (``warnings.warn`` would bypass both the class
    and the user's line)."""
    problems = []
    for path in paths:
        if path.name == "_warnings.py":
            continue
        for line, call in _warn_calls(path):
            where = f"{path.relative_to(path.parents[2])}:{line}"
            if isinstance(call.func, ast.Attribute):
                problems.append(f"{where}: {ast.unparse(call.func)}(); use phalanx._warnings.warn")
                continue
            category = call.args[1] if len(call.args) > 1 else None
            category = category or next(
                (k.value for k in call.keywords if k.arg == "category"), None
            )
            if not isinstance(category, ast.Name):
                problems.append(f"{where}: warn() without a warning class")
            elif not issubclass(getattr(_warnings, category.id, Warning), _warnings.PhalanxWarning):
                problems.append(f"{where}: {category.id} is not a phalanx._warnings class")
    return problems


def test_every_warning_in_the_library_has_a_phalanx_class():
    paths = sorted(SRC.rglob("*.py"))
    assert len([c for p in paths for c in _warn_calls(p)]) >= 10  # the check sees the calls
    assert _phalanx_warning_problems(paths) == []


def test_the_warning_check_can_fail(tmp_path):
    bad = tmp_path / "src" / "phalanx" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text(
        "import warnings\nfrom phalanx._warnings import warn\n"
        "warnings.warn('a')\nwarn('b')\nwarn('c', UserWarning)\nwarn('d', HintWarning)\n"
    )
    problems = _phalanx_warning_problems([bad])
    assert [p.split(": ", 1)[1] for p in problems] == [
        "warnings.warn(); use phalanx._warnings.warn",
        "warn() without a warning class",
        "UserWarning is not a phalanx._warnings class",
    ]


def test_the_warning_classes_are_public_and_filter_by_class():
    assert issubclass(phalanx.PhalanxWarning, UserWarning)
    for cls in (phalanx.FallbackWarning, phalanx.HintWarning, phalanx.NonFiniteWarning):
        assert issubclass(cls, phalanx.PhalanxWarning)
    assert issubclass(phalanx.PhalanxDeprecationWarning, DeprecationWarning)
    assert phalanx.optim.NonFiniteWarning is phalanx.NonFiniteWarning  # the old name stays
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", phalanx.FallbackWarning)
        _warnings.warn("a fallback", phalanx.FallbackWarning)
        _warnings.warn("a hint", phalanx.HintWarning)
    assert [str(w.message) for w in caught] == ["a hint"]
    assert caught[0].filename == __file__  # attributed to the caller's line


def test_a_fallback_is_a_fallback_warning():
    """One emitted warning, end to end: auto's fallback to the loop (a member whose forward
    turns data into a Python value, which the fused path cannot batch)."""
    import torch
    from torch import nn

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return h if h.sum() > 0 else -h

    stack = phalanx.stack([Branchy() for _ in range(3)])
    with pytest.warns(phalanx.FallbackWarning, match="backend 'auto' runs 'loop' instead"):
        stack(torch.randn(4, 3))


def test_the_pyproject_filters_still_name_classes_that_match():
    """pytest's filterwarnings turn phalanx's UserWarning and DeprecationWarning into errors:
    the classes still derive from those."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    filters = config["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert "error::UserWarning:phalanx.*" in filters
    assert issubclass(phalanx.PhalanxWarning, UserWarning)
    assert issubclass(phalanx.PhalanxDeprecationWarning, DeprecationWarning)


# ----------------------------------------------------------------------------- __all__, dir()


def _public_surface_problems(module: types.ModuleType) -> list[str]:
    name = module.__name__
    declared = list(getattr(module, "__all__", None) or [])
    if not hasattr(module, "__all__"):
        return [f"{name} has no __all__"]
    problems = [
        f"{name}.__all__ names {n!r}, which it lacks" for n in declared if not hasattr(module, n)
    ]
    if len(set(declared)) != len(declared):
        problems.append(f"{name}.__all__ repeats a name")
    if sorted(dir(module)) != sorted({*declared, *(["__version__"] if name == "phalanx" else [])}):
        extra = sorted(set(dir(module)) - set(declared) - {"__version__"})
        problems.append(f"dir({name}) is not its __all__: also {extra}")
    for attr, value in vars(module).items():  # defined here (or in a private submodule)
        owner = getattr(value, "__module__", None) or ""
        defined_here = owner == name or owner.startswith(f"{name}._")
        if (
            not attr.startswith("_")
            and not inspect.ismodule(value)
            and defined_here
            and attr not in declared
        ):
            problems.append(f"{name}.{attr} is public but not in __all__")
    return problems


@pytest.mark.parametrize("name", PUBLIC + list(INTEGRATIONS))
def test_every_public_module_lists_its_surface_in_all(name):
    tool = INTEGRATIONS.get(name)
    if tool is not None:
        pytest.importorskip(tool)
    assert _public_surface_problems(importlib.import_module(name)) == []


def test_the_surface_check_can_fail():
    module = types.ModuleType("phalanx.fake")
    module.__all__ = ["kept", "gone"]

    def kept() -> None: ...

    def forgotten() -> None: ...

    kept.__module__ = forgotten.__module__ = "phalanx.fake"
    module.kept, module.forgotten, module.os = kept, forgotten, types  # type: ignore[attr-defined]
    problems = _public_surface_problems(module)
    assert "phalanx.fake.__all__ names 'gone', which it lacks" in problems
    assert any(p.startswith("dir(phalanx.fake) is not its __all__") for p in problems)
    assert "phalanx.fake.forgotten is public but not in __all__" in problems


def test_every_module_is_public_internal_or_private():
    """A new module without an underscore is a decision: add it to PUBLIC (and give it an
    __all__) or to INTERNAL."""
    undecided = []
    for info in pkgutil.walk_packages([str(SRC)], "phalanx."):
        parts = info.name.split(".")[1:]
        if any(p.startswith("_") for p in parts) or parts[0] in INTERNAL:
            continue
        if info.name not in PUBLIC and info.name not in INTEGRATIONS:
            undecided.append(info.name)
    assert undecided == []


# -------------------------------------------------------------------------------- lazy import


def _run(code: str) -> str:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_phalanx_loads_no_submodule_until_a_name_is_used():
    out = _run(
        "import sys, phalanx\n"
        "print(sorted(m for m in sys.modules if m.startswith('phalanx.')))\n"
        "phalanx.stack\n"
        "print('phalanx.core._stack' in sys.modules, 'phalanx.distributed' in sys.modules)\n"
        "import phalanx.optim\n"
        "print(phalanx.optim.Adam.__name__, phalanx.distributed.shard.__name__)\n"
    )
    assert out.splitlines() == ["[]", "True False", "Adam shard"]


def test_every_public_name_of_phalanx_resolves_and_stays():
    for name in phalanx.__all__:
        value = getattr(phalanx, name)
        assert vars(phalanx)[name] is value  # looked up once, then an ordinary attribute
    with pytest.raises(AttributeError, match="module 'phalanx' has no attribute 'stak'"):
        phalanx.stak  # noqa: B018


def test_the_type_checking_imports_match_the_lazy_table():
    """The names type checkers read (the ``if TYPE_CHECKING:`` imports) are the names
    ``__getattr__`` serves, from the same modules."""
    tree = ast.parse((SRC / "__init__.py").read_text())
    (block,) = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    # __getattr__ only at run time: to a type checker, a misspelt phalanx.name is an error
    (runtime,) = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "not TYPE_CHECKING"
    ]
    assert [f.name for f in runtime.body] == ["__getattr__"]
    assert "__getattr__" not in [getattr(n, "name", None) for n in tree.body]
    typed = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom)
        for alias in node.names:
            typed[alias.name] = (
                f"{node.module}.{alias.name}" if node.module == "phalanx" else node.module
            )
    assert typed == phalanx._WHERE
    assert sorted(phalanx._WHERE) == phalanx.__all__


# ------------------------------------------------------------------- version, licence, -m


def test_the_version_is_written_once():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in config["project"]
    assert config["project"]["dynamic"] == ["version"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "phalanx.__version__"}
    assert phalanx.__version__.count(".") == 2


def test_the_licence_is_an_spdx_string_with_its_file():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert config["license"] == "MIT"
    assert config["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert not any(c.startswith("License ::") for c in config["classifiers"])  # PEP 639
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog


def test_python_m_phalanx_prints_the_version_and_the_commands():
    out = _run(
        "import runpy, sys; sys.argv = ['phalanx']; runpy.run_module('phalanx', run_name='__main__')"
    )
    assert out.startswith(f"phalanx {phalanx.__version__} (Python ")
    assert "backends: fused, vmap, loop" in out
    assert "phalanx bench" in out and "phalanx demo" in out
    version = subprocess.run(
        [sys.executable, "-m", "phalanx", "--version"],
        capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src")}, check=True,
    )  # fmt: skip
    assert version.stdout.strip() == f"phalanx {phalanx.__version__}"


def test_the_command_help_is_plain_text():
    done = subprocess.run(
        [sys.executable, "-m", "phalanx_tools", "--help"], capture_output=True, text=True,
        env={"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tools' / 'src'}"}, check=True,
    )  # fmt: skip
    assert "``" not in done.stdout and ":func:" not in done.stdout
    assert "phalanx bench" in done.stdout
    version = subprocess.run(
        [sys.executable, "-m", "phalanx_tools", "--version"], capture_output=True, text=True,
        env={"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tools' / 'src'}"}, check=True,
    )  # fmt: skip
    assert version.stdout.strip() == f"phalanx {phalanx.__version__}"
