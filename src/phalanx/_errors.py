"""How phalanx quotes an exception inside its own messages: one line, the type first."""

from __future__ import annotations


def first_line(error: BaseException, limit: int | None = None) -> str:
    """The first non-empty line of ``error``'s message ("" for an empty one), cut to ``limit``."""
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else ""
    return line if limit is None else line[:limit]


def summary(error: BaseException, limit: int | None = None) -> str:
    """``"Type: first line"`` (just ``"Type"`` for an empty message), as the messages quote it.

    Example:
        >>> summary(ValueError("bad offsets\\nmore detail"))
        'ValueError: bad offsets'
    """
    return f"{type(error).__name__}: {first_line(error, limit)}".rstrip(": ")
