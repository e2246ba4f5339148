"""The model zoo, which lives beside the tests (``tests/zoo``: published code with its licences).

The zoo is not part of any wheel: the real-model benchmark runs from a checkout.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

_TESTS = Path(__file__).resolve().parents[3] / "tests"


def load() -> ModuleType:
    """Imports ``tests/zoo`` of the checkout this package was installed from."""
    if not (_TESTS / "zoo" / "__init__.py").is_file():
        raise ModuleNotFoundError(
            f"the real-model zoo is not at {_TESTS / 'zoo'}: it ships with the source checkout, "
            "not with a wheel; run `phalanx bench --real` from a clone of the repository "
            "(`make bench`)."
        )
    if str(_TESTS) not in sys.path:
        sys.path.insert(0, str(_TESTS))
    return importlib.import_module("zoo")
