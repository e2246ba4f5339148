"""The progress bar of a long search: on a terminal by default, or as ``progress=`` says."""

from __future__ import annotations

import sys
from typing import Any


def progress_bar(progress: bool | None, *, total: int, desc: str, unit: str) -> Any:
    """A ``tqdm`` bar on standard error: shown when ``progress`` is True, or when it is None and
    standard error is a terminal (not a log file, a pipe or a notebook's captured stream)."""
    from tqdm import tqdm

    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"{desc}: progress must be True, False or None; got {progress!r}.")
    show = sys.stderr.isatty() if progress is None else progress
    return tqdm(
        total=total, desc=desc, unit=unit, file=sys.stderr, disable=not show, dynamic_ncols=True
    )
