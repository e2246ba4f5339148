"""``python -m phalanx``: the version, what this installation can run, and where the commands are.

The benchmark and the demo (``phalanx bench``, ``phalanx demo``) are phalanx's tooling, kept
beside the library and out of its wheel; this module only points to them, so that the library
never imports its tooling.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import importlib.util
import re
import sys

import torch

import phalanx

_DESCRIPTION = (
    "Print phalanx's version, the torch it runs on, its backends, which optional extras are "
    "installed, and where the benchmark and demo commands are."
)


def _extras() -> list[tuple[str, list[str], list[str]]]:
    """(extra, its packages, those missing) for each user-facing extra in phalanx's metadata."""
    try:
        requires = metadata.requires("phalanx") or []
    except metadata.PackageNotFoundError:  # imported from a source tree, not installed
        return []
    packages: dict[str, list[str]] = {}
    for line in requires:
        found = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", line)
        if found and found.group(1) not in {"dev", "bench"}:
            packages.setdefault(found.group(1), []).append(re.split(r"[\s;<>=!~\[]", line)[0])
    out = []
    for extra, names in packages.items():
        missing = []
        for name in names:
            try:
                metadata.version(name)
            except metadata.PackageNotFoundError:
                missing.append(name)
        out.append((extra, names, missing))
    return out


def report() -> str:
    """The text ``python -m phalanx`` prints."""
    cuda = (
        f"{torch.cuda.device_count()} CUDA device(s): {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else "no CUDA device"
    )
    lines = [
        f"phalanx {phalanx.__version__} (Python {sys.version.split()[0]}, torch "
        f"{torch.__version__}, {cuda})",
        f"backends: {', '.join(phalanx.BACKENDS)}; backend='auto' (the default) runs 'fused', "
        "or 'loop' where 'fused' refuses",
    ]
    extras = _extras()
    if extras:
        lines.append("optional extras (pip install 'phalanx[EXTRA]'):")
        for extra, names, missing in extras:
            state = "installed" if not missing else f"missing {', '.join(missing)}"
            lines.append(f"  {extra:10s} {' '.join(names):40s} {state}")
    else:
        lines.append("phalanx is imported from a source tree, not installed: no extras to list")
    tools = importlib.util.find_spec("phalanx_tools") is not None
    lines.append(
        "commands: 'phalanx bench' (the benchmark) and 'phalanx demo' (a training sweep) "
        + (
            "are installed."
            if tools
            else "come with the tools in phalanx's source repository: pip install ./tools "
            "there (or make bench / make demo)."
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phalanx", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"phalanx {phalanx.__version__}")
    parser.parse_args(argv)
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
