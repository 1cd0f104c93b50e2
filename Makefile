# The two commands of the README: `make serve` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint venv gpu-check

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[engine,adapter,test,deploy]'
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m backend.launcher $(ARGS)

test: lint
	$(PY) -m pytest $(ARGS)

# ruff, its format check and mypy ([tool.mypy] in pyproject.toml). Each model.py is checked on
# its own: Triton loads each as a module named `model`.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m mypy model_repository/llm/1/model.py
	$(PY) -m mypy model_repository/preprocessing/1/model.py

# The prepared GPU check, with the machine's own python3 and packages: it installs nothing
# (bench/gpu_check.py; the device-tool command is in bench/RESULTS.md, "GPU").
GPU_CHECK_OUT ?= .cache/gpu-check
gpu-check:
	PYTHONPATH=. $(PYTHON) -m bench.gpu_check --out $(GPU_CHECK_OUT) $(ARGS)
