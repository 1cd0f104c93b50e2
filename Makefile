# The two commands of the README: `make serve` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# What each command installs: serving needs the engine and the adapter; the suite also needs its
# tools and the validators of docker/ and deploy/. A stamp per set, so that `make serve` on a
# fresh clone installs no test tools and `make test` after it adds only those.
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test

.PHONY: serve test lint venv gpu-check

venv: $(TEST_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(SERVE_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[engine,adapter]'
	touch $@

$(TEST_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[engine,adapter,test,deploy]'
	touch $@

serve: $(SERVE_STAMP)
	$(PY) -m backend.launcher $(ARGS)

test: lint
	$(PY) -m pytest $(ARGS)

# ruff, its format check and mypy ([tool.mypy] in pyproject.toml). Each model.py is checked on
# its own: Triton loads each as a module named `model`.
lint: $(TEST_STAMP)
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
