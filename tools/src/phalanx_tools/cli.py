"""The ``phalanx`` command: ``phalanx bench`` and ``phalanx demo``.

Each subcommand lives in its own module with two functions, ``add_arguments(parser)`` and
``run(args) -> int``, imported only when that subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import phalanx

# --help shows this text as it stands: plain words, no reST markup.
_DESCRIPTION = (
    "phalanx's benchmark and demo: 'phalanx bench' times the benchmark workloads, "
    "'phalanx demo' runs a real training sweep. 'python -m phalanx' prints the library's "
    "version and set-up."
)

_SUBCOMMANDS = {
    "bench": (
        "phalanx_tools.bench.cli",
        "time the benchmark workloads against the loop and torch.func",
    ),
    "demo": ("phalanx_tools.demo", "train a population of networks on scikit-learn's digits"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="phalanx", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"phalanx {phalanx.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in _SUBCOMMANDS.items():
        subparser = sub.add_parser(name, help=help_text, description=help_text)
        if argv and argv[0] == name:  # import only the subcommand that runs
            importlib.import_module(module_name).add_arguments(subparser)
    args = parser.parse_args(argv)
    module = importlib.import_module(_SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
