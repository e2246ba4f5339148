"""phalanx inside the tools people train with: one module per tool, each an optional extra.

Each module imports its tool lazily-at-import-of-the-module (``import phalanx.integrations.x``
needs the tool installed; ``import phalanx`` never does) and keeps the members independent
inside the tool's own loop, or refuses at set-up naming the fix.
"""
