"""An `llm` model file whose first load works and whose every later load crashes its stub, as a
model does that keeps failing at load (tests/integration/test_engine_death.py)."""

import os
import sys
from pathlib import Path

LOADED_ONCE = Path(__file__).with_name("loaded-once")


class TritonPythonModel:
    def initialize(self, args) -> None:
        if LOADED_ONCE.exists():
            print("crashing_llm: crashed at load", file=sys.stderr, flush=True)
            os._exit(3)
        LOADED_ONCE.touch()

    def execute(self, requests) -> None:
        return None
