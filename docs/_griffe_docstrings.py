"""A griffe extension: reads phalanx's Google-style docstrings as the reST-flavoured text they are.

The docstrings are written for ``help()`` and doctest as much as for the site, so three habits
of theirs are translated here, at render time, instead of rewritten in the source:

- ``Example:`` (singular) heads a doctest: griffe reads only ``Examples:`` as one (the singular
  is an admonition, whose ``>>>`` lines Markdown would take for nested quotes).
- ``a, b, c: text`` in ``Args:`` documents several parameters at once: each gets the text.
- Sphinx roles (``:class:`Stack```, ``:func:``, ``:meth:``, ...) become code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|obj|exc|py:\w+):`~?([^`]+)`")
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Keyword Args|Other Parameters):[ \t]*$")
_MULTI = re.compile(r"^(\s+)(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)+)(\s*(?:\([^)]*\))?\s*:)(.*)$")


def _split_multi(text: str) -> str:
    out: list[str] = []
    lines = text.split("\n")
    section_indent: int | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        head = _SECTION.match(line)
        if head:
            section_indent = len(head.group(1))
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        if line.strip() and section_indent is not None and indent <= section_indent:
            section_indent = None
        multi = _MULTI.match(line) if section_indent is not None else None
        if multi:
            pad, names, colon, rest = multi.groups()
            body = [rest]
            j = i + 1
            while j < len(lines) and (
                not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > len(pad)
            ):
                body.append(lines[j])
                j += 1
            while body and not body[-1].strip():
                j -= 1
                body.pop()
            for name in (n.strip() for n in names.split(",")):
                out.append(f"{pad}{name}{colon}{body[0]}")
                out.extend(body[1:])
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _translate(text: str) -> str:
    text = _EXAMPLE.sub(r"\1Examples:", text)
    text = _ROLE.sub(r"`\1`", text)
    return _split_multi(text)


class PhalanxDocstrings(griffe.Extension):
    """Translates each docstring once, when griffe has loaded its object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _translate(obj.docstring.value)
