"""Every ``>>>`` example in phalanx's docstrings runs and shows what it says.

The examples are run as doctests with their module's names and ``torch``, ``nn``, ``F`` and
``phalanx`` in scope, in a scratch directory (some save files), under a fixed seed.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx


def _docstring_tests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder()
    found = []
    modules = ["phalanx"] + [
        info.name for info in pkgutil.walk_packages(phalanx.__path__, prefix="phalanx.")
    ]
    for name in modules:
        module = importlib.import_module(name)
        scope = {
            **{k: getattr(module, k) for k in dir(module) if not k.startswith("__")},
            "torch": torch,
            "nn": nn,
            "F": F,
            "phalanx": phalanx,
        }
        for test in finder.find(module, globs=scope):
            if test.examples and test.name.split(".")[-1] != "__getattr__":
                found.append(test)
    return sorted(found, key=lambda t: t.name)


TESTS = _docstring_tests()


def test_the_docstrings_hold_examples():
    """The collection itself must find the examples (it fails if the walk finds none)."""
    assert len(TESTS) >= 24, [t.name for t in TESTS]


@pytest.mark.parametrize("test", TESTS, ids=[t.name for t in TESTS])
def test_docstring_example_runs(test: doctest.DocTest, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    report: list[str] = []
    result = runner.run(test, out=report.append, clear_globs=True)
    assert result.failed == 0, "".join(report)
