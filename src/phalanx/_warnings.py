"""phalanx's warnings: one class per kind, so users filter by class, given at the user's line.

Every warning phalanx gives is a :class:`PhalanxWarning`; its subclasses say what kind:

- :class:`FallbackWarning`: phalanx runs a slower path than the one asked for or expected
  (``backend='auto'`` runs the loop, a captured step runs eagerly, an export keeps the loop's
  graph); results are the same, only the speed differs.
- :class:`HintWarning`: an input or a setting that runs, but rarely means what its writer
  meant (a keyword input shaped per member, a shared input that requires grad).
- :class:`NonFiniteWarning`: members were skipped or frozen for a non-finite loss or gradient.
- :class:`PhalanxDeprecationWarning`: a form that still works and will be removed.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", phalanx.FallbackWarning)  # silence fallbacks only
    ...     warnings.warn("runs the loop", phalanx.FallbackWarning)  # not shown

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


class PhalanxWarning(UserWarning):
    """The base class of every warning phalanx gives (a ``UserWarning``): filter it, or one of
    its subclasses, to silence or raise phalanx's warnings by kind."""


class FallbackWarning(PhalanxWarning):
    """phalanx runs a slower path than the one asked for or expected, with the same results
    (the message names the reason and how to choose the path directly)."""


class HintWarning(PhalanxWarning):
    """An input or a setting that runs, but rarely means what its writer meant (the message
    names the likely intent and the call that expresses it)."""


class SharedInputWarning(HintWarning):
    """A shared input that looks like one meant per member (``in_dims=0``).

    Given once per stack. Where the input really is one batch shared by every member, silence
    it with ``warnings.filterwarnings("ignore", category=phalanx.SharedInputWarning)``.
    """


class StackSplitWarning(HintWarning):
    """A search batch that falls apart into several stacks because its networks differ.

    Each stack then costs about what a whole batch would: a batch of N trials in N stacks of
    one runs at the speed of trials one by one.
    """


class CompileWarning(PhalanxWarning):
    """phalanx compiles a kernel once (seconds; inductor's disk cache makes a later process's
    compile shorter), because the computation asked for runs much faster compiled (the
    message names what and the setting that avoids the compile)."""


class NonFiniteWarning(PhalanxWarning):
    """Members were skipped (or frozen) because their loss or gradients were not finite."""


class PhalanxDeprecationWarning(PhalanxWarning, DeprecationWarning):
    """A form of a call that still works and will be removed; the message names its
    replacement. Shown where Python shows a ``DeprecationWarning``."""


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside phalanx and torch."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((_PHALANX, _TORCH)):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    return level


def warn(message: str, category: type[PhalanxWarning] = PhalanxWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line that called phalanx."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
