VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test lint docs bench docs-bench clean

$(STAMP): pyproject.toml tools/pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]' -e tools
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/phalanx demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests tools examples benchmarks docs/guides/*.py docs/*.py
	$(VENV)/bin/ruff format --check src tests tools examples benchmarks docs/guides/*.py docs/*.py
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# the site, into site/; --strict: a broken link, a missing reference or a cited file fails
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

test: lint docs
	$(VENV)/bin/pytest

bench: $(STAMP)
	$(VENV)/bin/phalanx bench

docs-bench: $(STAMP)
	$(PY) benchmarks/write_benchmarks_md.py

clean:
	rm -rf $(VENV) site build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
