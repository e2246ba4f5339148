"""phalanx inside the tools people train with: one module per tool, each an optional extra.

Each module imports its tool lazily-at-import-of-the-module (``import phalanx.integrations.x``
needs the tool installed; ``import phalanx`` never does) and keeps the members independent
inside the tool's own loop, or refuses at set-up naming the fix.
"""

# Each tool's module is imported by its name (``import phalanx.integrations.optuna``): importing
# one needs its tool installed, so none is imported here or by ``from ... import *``.
__all__: list[str] = []


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
