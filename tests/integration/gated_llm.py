"""The test repository's `llm` model: the product's model.py with a gate the tests close to
hold generation, so that a request is still in flight when a test needs it to be, however fast
the machine.

While the file `GATE_FILE` exists in the model's folder the engine takes no step in which every
sequence already has a token: each request admitted gets its first token, then nothing
advances until the gate opens (`tests.integration.openai_support.held`). Importing this file
outside Triton is safe: the product model is loaded in `initialize`.
"""

import functools
import importlib.util
import time
from pathlib import Path
from types import ModuleType

GATE_FILE = "gate"


def _product_model() -> ModuleType:
    from backend.repository import TEMPLATE

    path = TEMPLATE / "llm" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("llm_product_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hold_while_gated(gate: Path, engine) -> None:
    """Run in the engine's process (`TritonPythonModel.prepare_engine`), which imports this file
    as `model` too: the stub's folder is on its path."""
    step = engine._step

    def gated_step() -> None:
        while gate.exists() and all(seq.generated for seq in engine._active):
            engine._admit()  # a request arriving meanwhile still gets its first token
            engine._publish_stats()  # which leaves the engine's process with the stats
            time.sleep(0.01)
        step()

    engine._step = gated_step


class TritonPythonModel:
    def initialize(self, args) -> None:
        self._model = _product_model().TritonPythonModel()
        gate = Path(args["model_repository"]) / GATE_FILE
        self._model.prepare_engine = functools.partial(hold_while_gated, gate)
        self._model.initialize(args)

    def execute(self, requests) -> None:
        return self._model.execute(requests)

    def finalize(self) -> None:
        self._model.finalize()
