# The two commands of the README: `make serve` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[engine,adapter,test,deploy]'
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m backend.launcher $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
