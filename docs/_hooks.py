"""mkdocs hooks: a page that cites a file of the repository that does not exist fails the build.

mkdocs checks the links between pages; the pages also name files outside the site (a script in
``examples/``, a test, a benchmark) in code spans. Each such path is checked against the
checkout, and any path under ``repro/`` (evidence scripts kept outside the repository) is
refused. Both are logged as warnings, which ``mkdocs build --strict`` turns into a failure.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.phalanx")

ROOT = Path(__file__).resolve().parent.parent
_CITED = re.compile(
    r"(?<![\w/.-])((?:examples|tests|benchmarks|src|tools|docs|\.ci)/[\w./-]*[\w-]"
    r"(?:\.(?:py|md|json|png|toml|sh|txt|yml|yaml|cfg))?)(?![\w/-])"
)
_REPRO = re.compile(r"(?<![\w-])(?:\.\./)?(?:shared/)?repro/[\w./-]+")


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Warns about every cited repository path that is missing, and every ``repro/`` path."""
    where = page.file.src_uri
    for match in _CITED.finditer(markdown):
        path = match.group(1).rstrip(".")
        if markdown[match.end() : match.end() + 1] in ("<", "*", "{"):
            continue  # a pattern such as src/phalanx/optim/_<name>.py, not a file
        if not (ROOT / path).exists():
            log.warning("%s cites %s, which is not in the repository", where, path)
    for match in _REPRO.finditer(markdown):
        log.warning(
            "%s cites %s: evidence scripts outside the repository cannot be cited",
            where,
            match.group(0),
        )
    return markdown
