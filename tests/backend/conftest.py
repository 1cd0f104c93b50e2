"""Fixtures of the backend's unit tests: the fake `triton_python_backend_utils`, and the
repository's model.py files imported (and initialized) in-process on the test model."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from backend import default_model
from backend.engine import Engine
from backend.model_runner import ModelRunner
from tests.backend.triton_config import MODEL_REPOSITORY, config_parameters, model_config_json
from tests.fakes import pb_utils as fake_pb_utils
from tests.reference import tokenizer

_module_ids = itertools.count()


@pytest.fixture
def pb_utils() -> Iterator[ModuleType]:
    """The fake module (tests.fakes.pb_utils), its metrics and log records reset."""
    fake_pb_utils.reset()
    yield fake_pb_utils
    fake_pb_utils.reset()


@pytest.fixture
def import_model(
    pb_utils: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> Callable[[str], ModuleType]:
    """Import `model_repository/<name>/1/model.py` afresh, under a unique module name, with the
    fake as `sys.modules["triton_python_backend_utils"]`, staged as Triton's stub does: the
    Python-level names during the import, the stub's classes added right after."""

    def load(name: str) -> ModuleType:
        staged = ModuleType("triton_python_backend_utils")
        for attr in pb_utils.PYTHON_NAMES:
            setattr(staged, attr, getattr(pb_utils, attr))
        monkeypatch.setitem(sys.modules, "triton_python_backend_utils", staged)
        path = MODEL_REPOSITORY / name / "1" / "model.py"
        spec = importlib.util.spec_from_file_location(f"_model_{name}_{next(_module_ids)}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for attr in pb_utils.STUB_NAMES:
            setattr(staged, attr, getattr(pb_utils, attr))
        return module

    return load


@pytest.fixture
def model_args(model_dir: Path) -> Callable[..., dict[str, str]]:
    """`initialize(args)` for a model: config.pbtxt's parameters, `model_path` = the test model."""

    def make(model: str, decoupled: bool | None = True, **parameters: str) -> dict[str, str]:
        values = {**config_parameters(model), "model_path": str(model_dir), **parameters}
        return {
            "model_config": model_config_json(model, values, decoupled),
            "model_repository": str(MODEL_REPOSITORY / model),
            "model_name": model,
            "model_version": "1",
        }

    return make


@pytest.fixture
def llm_model(
    import_model: Callable[[str], ModuleType], model_args: Callable[..., dict[str, str]]
) -> Iterator[Any]:
    """The real llm model.py, initialized (engine thread running); finalized afterwards."""
    model = import_model("llm").TritonPythonModel()
    model.initialize(model_args("llm"))
    yield model
    model.finalize()


@pytest.fixture
def preprocessing_model(
    import_model: Callable[[str], ModuleType], model_args: Callable[..., dict[str, str]]
) -> Any:
    model = import_model("preprocessing").TritonPythonModel()
    model.initialize(model_args("preprocessing", decoupled=None))
    return model


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    """16 slots of 256 positions on the test model (a module may define its own)."""
    return ModelRunner(str(model_dir), max_num_seqs=16, max_model_len=256)


@pytest.fixture
def engine(runner: ModelRunner) -> Iterator[Engine]:
    """A started engine on `runner`, stopped after the test."""
    engine = Engine(runner)
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture
def passage(model_dir: Path) -> list[int]:
    """The default model's memorised passage, as ids of the test model."""
    return tokenizer(model_dir)(default_model.PASSAGE)["input_ids"]
