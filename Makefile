PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install install-dev demo test lint typecheck clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned here (a CPU build ships on these machines); pyproject keeps a broad range.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e .
	touch $@

$(DEV_STAMP): pyproject.toml | $(PY)
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[dev,serve]"
	touch $(STAMP) $@

install: $(STAMP)

install-dev: $(DEV_STAMP)

demo: $(STAMP)
	$(VENV)/bin/momlp demo

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(DEV_STAMP)
	$(VENV)/bin/mypy

test: $(DEV_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -m "not gpu" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
