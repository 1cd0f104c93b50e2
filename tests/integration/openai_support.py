"""Helpers of the OpenAI-adapter integration tests: Triton called directly, reference checks."""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from backend import contract
from backend.adapter_server import AdapterServer
from backend.tritonserver import TritonServer
from tests.integration.gated_llm import GATE_FILE
from tests.reference import reference_logprobs, tokenizer
from tests.streaming import StreamResult, generate

ATOL = 1e-4
# How long `wait_for` polls: far beyond what any awaited condition takes on a loaded machine.
CONDITION_BOUND_S = 60.0
MODEL = "test-model"  # the adapter fixture's --served-model-name


def token_id(token: str) -> int:
    """The id in a `return_tokens_as_token_ids` token, "token_id:N"."""
    match = re.fullmatch(r"token_id:(\d+)", token)
    assert match, f"not a token_id:N token: {token!r}"
    return int(match.group(1))


def distinct(ids: Sequence[int]) -> list[int]:
    return list(dict.fromkeys(ids))


def text_prompt_ids(model_dir: Path, prompt: str) -> list[int]:
    """What `preprocessing` makes of a completions prompt."""
    return tokenizer(model_dir)(prompt)["input_ids"]


def chat_prompt_ids(
    model_dir: Path, messages: list[dict[str, str]], *, continue_final_message: bool = False
) -> list[int]:
    """What `preprocessing` makes of chat messages: the template with the generation prompt,
    or with the final message left open."""
    tok = tokenizer(model_dir)
    rendered = tok.apply_chat_template(
        messages,
        add_generation_prompt=not continue_final_message,
        continue_final_message=continue_final_message,
        tokenize=False,
    )
    return tok(rendered, add_special_tokens=False)["input_ids"]


def triton_direct(
    grpc_url: str,
    *,
    text: str | None = None,
    messages: list[dict[str, str]] | None = None,
    max_tokens: int,
    logprobs: int | None = None,
    logprob_token_ids: Sequence[int] = (),
) -> StreamResult:
    """The same greedy request sent to Triton's `ensemble` with tritonclient, no adapter."""
    arrays: dict[str, np.ndarray] = {
        contract.MAX_TOKENS: np.array([max_tokens], np.int32),
        contract.TEMPERATURE: np.array([0.0], np.float32),
    }
    if text is not None:
        arrays[contract.TEXT_INPUT] = np.array([text.encode()], dtype=object)
    else:
        arrays[contract.MESSAGES] = np.array([json.dumps(messages).encode()], dtype=object)
    if logprobs is not None:
        arrays[contract.LOGPROBS] = np.array([logprobs], np.int32)
    if logprob_token_ids:
        arrays[contract.LOGPROB_TOKEN_IDS] = np.array(logprob_token_ids, np.int32)
    result = generate(grpc_url, "ensemble", arrays)
    assert result.error is None, result.error
    return result


def assert_near_reference(
    model_dir: Path,
    prompt_ids: list[int],
    output_ids: list[int],
    positions: Sequence[dict[int, float]],
) -> None:
    """Each position's {id: logprob} equals the float64 log-softmax within ATOL."""
    ref = reference_logprobs(model_dir, prompt_ids, output_ids)
    assert len(positions) == len(output_ids)
    for i, entries in enumerate(positions):
        for token, logprob in entries.items():
            assert math.isfinite(logprob) and logprob <= 0, (i, token, logprob)
            assert abs(logprob - ref[i, token]) < ATOL, (i, token, logprob, ref[i, token])


def reference_prompt_logprobs(model_dir: Path, prompt_ids: Sequence[int]) -> np.ndarray:
    """[P-1, V] float64: row i-1 is the log-softmax that scores prompt token i."""
    return reference_logprobs(model_dir, list(prompt_ids[:1]), list(prompt_ids[1:]))


def reference_next_logprobs(model_dir: Path, prompt_ids: Sequence[int]) -> np.ndarray:
    """[V] float64: the log-softmax of the token after the prompt."""
    return reference_logprobs(model_dir, list(prompt_ids), [0])[0]


def adapter_metric(adapter: AdapterServer, name: str) -> float:
    """One of the adapter's own metrics, from its /metrics (the scrape is a request in flight)."""
    with urllib.request.urlopen(f"{adapter.url}/metrics", timeout=5) as reply:
        body = reply.read().decode()
    match = re.search(rf"^{name} ([0-9.e+]+)$", body, re.MULTILINE)
    assert match, f"{name} not in the adapter's metrics"
    return float(match.group(1))


def metric(metrics_url: str, name: str) -> float:
    """One of the engine's counters or gauges from Triton's Prometheus endpoint."""
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        body = reply.read().decode()
    match = re.search(rf'^{name}\{{[^}}]*model="llm"[^}}]*\}} ([0-9.e+]+)$', body, re.MULTILINE)
    assert match, f"{name} not in Triton's metrics"
    return float(match.group(1))


def assert_generated_since(
    metrics_url: str, generated: float, finished: float, *, tokens: int
) -> None:
    """After one more request of `tokens` tokens finished, the engine has generated exactly
    those since the counters read `generated` and `finished`: nothing else (a cancelled
    request, say) went on generating. The engine updates the tokens before the finishes."""
    assert wait_for(lambda: metric(metrics_url, "llm_finished_requests_total") == finished + 1)
    assert metric(metrics_url, "llm_generated_tokens_total") == generated + tokens


def wait_for(condition: Callable[[], bool], timeout_s: float = CONDITION_BOUND_S) -> bool:
    """Polls `condition` until it holds; the bound only ends a wait for one that never will."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def sse_events(lines: Sequence[str]) -> list[Any]:
    """The JSON payloads of an SSE body's `data:` lines, then "[DONE]"."""
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]] + ["[DONE]"]


@contextlib.contextmanager
def held(triton_server: TritonServer) -> Iterator[None]:
    """Inside the block the session Triton's engine gives each request its first token, then
    holds it (`tests/integration/gated_llm.py`); the requests go on after the block."""
    gate = Path(triton_server.model_repository) / "llm" / GATE_FILE
    gate.touch()
    try:
        yield
    finally:
        gate.unlink()
