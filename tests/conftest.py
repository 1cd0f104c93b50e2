"""Session fixtures: the small test model and one real tritonserver serving it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from backend import default_model
from backend.repository import write_repository
from backend.tritonserver import TritonServer

# Property tests draw the same examples on every run (derived from each test), so that the suite
# fails for a change, never by the draw; HYPOTHESIS_PROFILE=default draws new ones.
settings.register_profile("suite", derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

# The session's `llm` is the product's model with a gate the tests can close (see that file).
GATED_LLM = Path(__file__).parent / "integration" / "gated_llm.py"
# Small enough for CPU tests; a context short enough to test the limit without huge prompts.
TEST_PARAMETERS = {
    "max_model_len": "256",
    "max_num_seqs": "8",
    "max_logprob_token_ids": "1024",
    # OpenAI's response_format has no whitespace switch; the small test model needs it off.
    "grammar_disable_any_whitespace": "true",
}


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return default_model.ensure(default_model.TEST_SPEC)


@pytest.fixture(scope="session")
def triton_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    run = tmp_path_factory.mktemp("triton")
    repository = write_repository(run / "model_repository", model_dir, TEST_PARAMETERS)
    shutil.copy(GATED_LLM, repository / "llm" / "1" / "model.py")
    server = TritonServer(
        repository, http_port=0, grpc_port=0, metrics_port=0, log_path=run / "tritonserver.log"
    )
    with server:
        yield server
