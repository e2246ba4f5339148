"""The documentation runs: the README's code, every guide's script (the newcomer check), the
code of every concept and topic page, an API reference that names every public name, and every
page of the nav rendered with its headings and code.

The guides' scripts are the code of the site's guides (each page includes its script), so a
guide that stops working fails here. Six of them are the newcomer tasks: a deep CNN ensemble
with bootstrap batches, a 32-MLP sweep with early stopping, a dynamics ensemble with a routed
call, a Q-ensemble with a target subset, Hugging Face models through the Trainer, an Optuna
search. Scripts run in a fresh interpreter, one thread, in a temporary folder; those that need
an optional tool are skipped where it is not installed (the dev extra has them all).

``phalanx.compile_step`` is run with ``backend="aot_eager"`` here: the same capture (the whole
step traced into one graph and checked against the eager step) without inductor's code
generation, which takes 10-20 s on a CPU. The strict site build itself is ``make docs``
(part of ``make test``); the reference test below builds the site once more into a temporary
folder to read the rendered pages.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from importlib.util import find_spec
from pathlib import Path

import pytest

import phalanx

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guides"

# compile_step without inductor (see the module docstring); and a warning from phalanx is an
# error: a guide a newcomer copies must not leave them a warning to puzzle over. Every phalanx
# warning goes through phalanx._warnings.warn, which calls warnings.warn.
_PRELUDE = """
import functools, os, runpy, sys, warnings
import phalanx
phalanx.compile_step = functools.partial(phalanx.compile_step, backend="aot_eager")
_warn, _ours = warnings.warn, os.path.join("phalanx", "_warnings.py")
def _strict(message, category=UserWarning, stacklevel=1, *args, **kwargs):
    if sys._getframe(1).f_code.co_filename.endswith(_ours):
        raise AssertionError(f"phalanx warned: {message}")
    return _warn(message, category, stacklevel + 1, *args, **kwargs)
warnings.warn = _strict
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run(script: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "offline",
    }
    return subprocess.run(
        [sys.executable, "-c", _PRELUDE, str(script), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=240,
    )


def _needs(*modules: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {missing} (the dev extra)")


def _python_blocks(page: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)
    assert len(blocks) >= 4, f"{page} has lost its code"
    return "\n".join(blocks)


def test_readme_python_blocks_run(tmp_path):
    """Every ```python block of the README, in order, as one script."""
    script = tmp_path / "readme.py"
    script.write_text(_python_blocks("README.md"))
    result = _run(script, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(r"^8 fused$", result.stdout, re.M), result.stdout
    assert re.search(r"^(captured|eager): ", result.stdout, re.M), result.stdout


def test_getting_started_python_blocks_run(tmp_path):
    """The site's Getting started page, every ```python block in order, as one script."""
    script = tmp_path / "getting_started.py"
    script.write_text(_python_blocks("docs/getting-started.md"))
    result = _run(script, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(r"^8 fused$", result.stdout, re.M), result.stdout


def test_the_site_index_is_the_readme():
    """docs/index.md is the README with the links made relative to the site."""
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "index.md").read_text()
    strip = lambda text: [  # noqa: E731
        line for line in text.splitlines() if "](" not in line and "docs/" not in line
    ]
    assert strip(readme) == strip(index), "regenerate docs/index.md from README.md"


def test_readme_is_a_landing_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


# (script, tools it needs, what it must print)
CASES = [
    pytest.param(
        "deep_ensemble.py", (), r"member accuracy: (\d\.\d\d ){7}\d\.\d\d\nensemble accuracy: ",
        id="newcomer-1-deep-cnn-ensemble",
    ),
    pytest.param(
        "sweep_early_stopping.py", (), r"\d+ of 32 members stopped early.*\nbest member \d+: lr ",
        id="newcomer-2-sweep-early-stopping",
    ),
    pytest.param(
        "dynamics_routed.py", (), r"routed call equals each member alone: True",
        id="newcomer-3-dynamics-routed",
    ),
    pytest.param(
        "q_ensemble.py", (), r"per-critic TD loss: (-?\d+\.\d+ ){9}-?\d+\.\d+\n",
        id="newcomer-4-q-ensemble-subset",
    ),
    pytest.param(
        "hf_trainer.py", ("transformers", "accelerate"),
        r"eval loss per member: (\d\.\d+ ){3}\d\.\d+\nmember_2/ loads with from_pretrained",
        id="newcomer-5-hf-trainer",
    ),
    pytest.param(
        "optuna_search.py", ("optuna",), r"32 trials in [2-9] stacks: .*\nbest trial \d+: ",
        id="newcomer-6-optuna",
    ),
    pytest.param("per_feature.py", (), r"output \(32, 400\) .*\nequals the loop: True", id="per-feature"),
    pytest.param(
        "hf_accelerate.py", ("transformers", "accelerate"),
        r"gradient norms before clipping: .*e\+0\d", id="accelerate",
    ),
    pytest.param(
        "lightning_sweep.py", ("pytorch_lightning",), r"members still training: \[", id="lightning"
    ),
    pytest.param(
        "ray_tune_search.py", ("ray", "optuna"), r"16 configurations; best phalanx_\d+", id="ray-tune"
    ),
    pytest.param(
        "torchrun_train.py", (), r"ranks 1, members per rank \[8\]\nvalidation loss per member: ",
        id="scale-out",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("script", "tools", "expected"), CASES)
def test_guide_script_runs(script, tools, expected, tmp_path):
    missing = [m for m in tools if find_spec(m) is None]
    if missing:
        pytest.skip(f"not installed: {missing} (the dev extra has them)")
    result = _run(GUIDES / script, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(expected, result.stdout), result.stdout


def test_every_guide_script_is_run_and_shown():
    """Each script under docs/guides/ is in CASES and included in a guide page."""
    scripts = {p.name for p in GUIDES.glob("*.py")}
    assert scripts == {case.values[0] for case in CASES}
    pages = "".join(p.read_text() for p in GUIDES.glob("*.md"))
    included = set(re.findall(r'--8<-- "docs/guides/([\w.]+)"', pages))
    assert scripts == included


def _public_names() -> dict[str, list[str]]:
    """Every public name: phalanx.__all__ and each public submodule's __all__."""
    modules = ["phalanx"] + [
        f"phalanx.{name}"
        for name in phalanx.__all__
        if type(getattr(phalanx, name)).__name__ == "module"
    ]
    integrations = ["accelerate", "lightning", "loggers", "optuna", "ray_tune", "torchrl"]
    modules += [f"phalanx.integrations.{m}" for m in ["transformers", *integrations]]
    names: dict[str, list[str]] = {}
    for module in modules:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue  # an optional tool not installed: its page is still built from source
        names[module] = [n for n in mod.__all__ if type(getattr(mod, n)).__name__ != "module"]
    return names


class _Ids(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.ids.update(v for k, v in attrs if k == "id" and v)

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).with_name("mkdocs"))
    if find_spec("mkdocstrings") is None or not Path(mkdocs).exists():
        pytest.skip("mkdocs-material and mkdocstrings are not installed (the dev extra has them)")
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def _parse(path: Path) -> _Ids:
    parser = _Ids()
    parser.feed(path.read_text())
    return parser


def test_api_reference_renders_every_public_name(site):
    ids: set[str] = set()
    for page in (site / "api").rglob("index.html"):
        ids |= _parse(page).ids
    missing = [
        f"{module}.{name}"
        for module, names in _public_names().items()
        for name in names
        if f"{module}.{name}" not in ids
    ]
    assert not missing, f"not in the API reference: {missing}"
    # the reference reads the docstrings: a signature, an argument table and an example
    api = _parse(site / "api" / "phalanx" / "index.html")
    text = "".join(api.text)
    assert "Stacks N modules of one architecture" in text
    assert "num_members" in text
    # doctests render as code, not as Markdown's nested quotes (docs/_griffe_docstrings.py)
    html = (site / "api" / "phalanx" / "index.html").read_text()
    assert "<blockquote>" not in html, "a docstring's >>> lines were read as quotes"
    assert "stack_in_place(model, &quot;heads&quot;)" in html or "stack_in_place" in text


def test_front_page_renders(site):
    page = _parse(site / "index.html")
    text = "".join(page.text)
    assert "phalanx.stack(models)" in text and "phalanx.compile_step" in text
    assert "make demo" in text and "pip install" in text


# Concept and topic pages: every ```python block runs, in order, as one script per page. A
# block that needs what a test cannot give (torchrun, a GPU, a Hugging Face download) is
# marked on the line above it with an HTML comment, `<!-- not run: why -->`, which the site
# does not show; such blocks are listed by the test below so the marks stay honest.
PAGES = [
    ("docs/concepts/captured-step.md", ()),
    ("docs/concepts/memory.md", ()),
    ("docs/concepts/optimizers.md", ()),
    ("docs/concepts/randomness.md", ()),
    ("docs/DISTRIBUTED.md", ()),
    ("docs/EXPORT.md", ()),
    ("docs/HF.md", ("transformers",)),
    ("docs/INTEGRATIONS.md", ("tensorboard",)),
    ("docs/POPULATION.md", ()),
    ("docs/SEARCH.md", ("optuna",)),
    ("docs/GPU.md", ()),
    ("docs/performance.md", ()),
    ("docs/troubleshooting.md", ()),
]


def _page_script(page: str) -> str:
    text = (ROOT / page).read_text()
    blocks = []
    for match in re.finditer(r"(<!-- not run: [^>]+ -->\n[ \t]*)?```python\n(.*?)```", text, re.S):
        if not match.group(1):
            blocks.append(match.group(2))
    return "\n".join(blocks)


_PAGES_DRIVER = """
import os, runpy, sys, traceback
for page, script in zip(sys.argv[1::2], sys.argv[2::2]):
    os.chdir(os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException:
        sys.exit(f"{page} failed:\\n{traceback.format_exc()}")
    print(f"ran {page}")
"""


def test_page_python_blocks_run(tmp_path):
    """Each concept and topic page's code, its ```python blocks in order, as one script.

    The pages run one after another in one interpreter (torch is imported once), each in a
    fresh namespace and folder; a failure names the page.
    """
    args: list[str] = []
    for k, (page, tools) in enumerate(PAGES):
        if any(find_spec(m) is None for m in tools):
            continue  # an optional tool not installed (the dev extra has them all)
        code = _page_script(page)
        assert code.strip(), f"{page} has no code that runs"
        folder = tmp_path / str(k)
        folder.mkdir()
        (folder / "page.py").write_text(code)
        args += [page, str(folder / "page.py")]
    driver = tmp_path / "pages.py"
    driver.write_text(_PAGES_DRIVER)
    result = _run(driver, tmp_path, *args)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("ran docs/") == len(args) // 2, result.stdout


def test_every_code_page_is_run():
    """Each page whose ```python blocks are not all included scripts or marked not run is run."""
    run = {page for page, _ in PAGES} | {"docs/getting-started.md", "docs/index.md"}
    pages = set()
    for path in (ROOT / "docs").rglob("*.md"):
        page = str(path.relative_to(ROOT))
        code = re.sub(r'^--8<-- "[^"]+"$', "", _page_script(page), flags=re.M)
        if code.strip():
            pages.add(page)
    assert pages <= run, f"pages whose code no test runs: {sorted(pages - run)}"


def _nav_pages() -> list[str]:
    import yaml

    def walk(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from walk(value)

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return list(walk(config["nav"]))


class _Page(HTMLParser):
    """The rendered article: its headings (level, text) and how many code blocks it shows."""

    def __init__(self) -> None:
        super().__init__()
        self.headings: list[tuple[int, str]] = []
        self.code_blocks = 0
        self._heading: int | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in ("h1", "h2", "h3") and self._heading is None:
            self._heading, self._text = int(tag[1]), []
        if tag == "pre":
            self.code_blocks += 1

    def handle_endtag(self, tag):
        if self._heading is not None and tag == f"h{self._heading}":
            self.headings.append((self._heading, "".join(self._text).strip().rstrip("¶").strip()))
            self._heading = None

    def handle_data(self, data):
        if self._heading is not None:
            self._text.append(data)


def test_every_nav_page_renders_its_headings_and_code(site):
    """Each page of the nav is rendered with its title, its Markdown headings and its code."""
    for page in _nav_pages():
        html = site / ("index.html" if page == "index.md" else page[: -len(".md")] + "/index.html")
        assert html.exists(), f"{page} was not rendered"
        rendered = _Page()
        rendered.feed(html.read_text())
        assert any(level == 1 for level, _ in rendered.headings), f"{page}: no title"
        source = (ROOT / "docs" / page).read_text()
        source = re.sub(r"```.*?```", "", source, flags=re.S)  # no headings inside code
        wanted = [
            re.sub(r"[`*]", "", m.group(2)).strip()
            for m in re.finditer(r"^(##|###) (.+)$", source, re.M)
        ]
        texts = [text for _, text in rendered.headings]
        missing = [h for h in wanted if h not in texts]
        assert not missing, f"{page}: headings not rendered: {missing}"
        fences = (ROOT / "docs" / page).read_text().count("\n```") // 2
        if page.startswith("api/"):
            continue  # the reference is checked above
        assert rendered.code_blocks >= fences, (
            f"{page}: {fences} code blocks, {rendered.code_blocks} shown"
        )
