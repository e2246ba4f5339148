"""phalanx's one way to warn: at the user's line, however deep inside phalanx the warning starts.

A fixed ``stacklevel`` is tied to today's call depth and points at phalanx's own frames as soon
as a call is refactored; :func:`warn` counts the frames instead.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

_PHALANX = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside phalanx and torch."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((_PHALANX, _TORCH)):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    return level


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line that called phalanx."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
