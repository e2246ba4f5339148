"""phalanx's tooling, beside the library and not in its wheel: the benchmark and the demo.

``phalanx bench`` and ``phalanx demo`` (the ``phalanx`` command this package installs) run them;
``make bench`` and ``make demo`` set up a virtual environment first. The tooling uses phalanx's
public API only.
"""
