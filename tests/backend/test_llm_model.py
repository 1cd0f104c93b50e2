"""The llm model.py driven in-process through the fake pb_utils: response flags, errors,
cancellation, metrics and lifecycle (the token values are checked in test_engine.py)."""

from __future__ import annotations

import gc
import multiprocessing
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from backend import default_model, response_writer
from backend.config import RESTARTS_ENV
from backend.contract import (
    CANCEL,
    COMPLETION_TOKENS,
    FINISH_REASON,
    IGNORE_EOS,
    INPUT_IDS,
    LOGPROB_TOKEN_IDS,
    LOGPROBS,
    MAX_TOKENS,
    OUTPUT_IDS,
    TEMPERATURE,
    TOP_P,
)
from tests.backend.triton_config import config_tensors
from tests.fakes.pb_utils import TRITONSERVER_RESPONSE_COMPLETE_FINAL as FINAL
from tests.fakes.pb_utils import FakeRequest
from tests.reference import reference_greedy, tokenizer

WAIT_S = 60.0
OUTPUT_NAMES = set(config_tensors("llm", "output"))


def i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def f32(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float32)


@pytest.fixture
def prompt(model_dir: Path) -> np.ndarray:
    return np.array(tokenizer(model_dir)(default_model.PASSAGE)["input_ids"][:8], dtype=np.int32)


def greedy_request(prompt: np.ndarray, max_tokens: int, request_id: str = "") -> FakeRequest:
    inputs = {
        INPUT_IDS: prompt,
        MAX_TOKENS: i32(max_tokens),
        TEMPERATURE: f32(0.0),
        IGNORE_EOS: np.array([True]),
    }
    return FakeRequest(inputs, request_id=request_id)


def wait_final(*requests: FakeRequest) -> None:
    for request in requests:
        assert request.sender.final.wait(WAIT_S), f"no FINAL for {request.request_id()!r}"


def engine_processes() -> set[multiprocessing.process.BaseProcess]:
    """The engine processes this process runs (`backend.engine_process`)."""
    return {p for p in multiprocessing.active_children() if p.name == "llm-engine"}


def test_each_request_gets_one_final_with_its_last_data_response(
    llm_model: Any, pb_utils: ModuleType, model_dir: Path, prompt: np.ndarray
) -> None:
    lengths = (1, 3, 6)
    requests = [greedy_request(prompt, n, request_id=f"r{n}") for n in lengths]
    assert llm_model.execute(requests) is None
    wait_final(*requests)
    llm_model.finalize()  # joins the engine thread: nothing can be sent after this

    expected_ids = reference_greedy(model_dir, prompt.tolist(), max(lengths))
    for request, n in zip(requests, lengths, strict=True):
        sent = request.sender.sent
        # A response carries every token since the last one: one or more.
        assert [flags for _, flags in sent] == [0] * (len(sent) - 1) + [FINAL]
        assert not any(response.has_error() for response, _ in sent)
        arrays = [response.as_arrays() for response, _ in sent]
        assert all(set(a) == OUTPUT_NAMES for a in arrays)
        sizes = [len(a[OUTPUT_IDS]) for a in arrays]
        assert min(sizes) >= 1
        counts = [int(a[COMPLETION_TOKENS][0]) for a in arrays]
        assert counts == np.cumsum(sizes).tolist() and counts[-1] == n
        reasons = [a[FINISH_REASON].tolist() for a in arrays]
        assert reasons == [[b""]] * (len(sent) - 1) + [[b"length"]]
        assert np.concatenate([a[OUTPUT_IDS] for a in arrays]).tolist() == expected_ids[:n]

    assert pb_utils.metric("llm_finished_requests_total").value() == len(lengths)
    assert pb_utils.metric("llm_generated_tokens_total").value() == sum(lengths)
    active = pb_utils.metric("llm_active_sequences")
    assert active.value() == 0
    # How many overlapped, and which snapshots were published, depends on timing.
    assert all(0 <= value <= len(lengths) for value in active.history)
    assert active.labels == {"model": "llm"}


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({TEMPERATURE: f32(-1.0)}, "TEMPERATURE: must be >= 0, got -1.0"),
        ({TOP_P: f32(0.0)}, "TOP_P: must be in (0, 1], got 0.0"),
        ({LOGPROBS: i32(21)}, "LOGPROBS: must be in [0, 20], got 21"),
        (
            {LOGPROB_TOKEN_IDS: i32(3, 1024)},
            "LOGPROB_TOKEN_IDS: id 1024 is outside the vocabulary [0, 1024)",
        ),
        (
            {INPUT_IDS: i32()},
            "INPUT_IDS: the prompt is empty (through the ensemble: TEXT_INPUT gave no token ids)",
        ),
    ],
)
def test_bad_input_is_invalid_arg_and_the_next_request_is_served(
    llm_model: Any,
    pb_utils: ModuleType,
    prompt: np.ndarray,
    inputs: dict[str, np.ndarray],
    message: str,
) -> None:
    bad = FakeRequest({INPUT_IDS: prompt, MAX_TOKENS: i32(2), **inputs}, request_id="bad")
    good = greedy_request(prompt, 2, request_id="good")
    llm_model.execute([bad, good])
    # Refused in execute itself, before the engine sees it: one error response, FINAL.
    assert bad.sender.final.is_set()
    [(response, flags)] = bad.sender.sent
    assert flags == FINAL
    assert response.output_tensors() == []
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert response.error().message() == message

    later = greedy_request(prompt, 3, request_id="later")
    llm_model.execute([later])
    wait_final(good, later)
    for request, n in ((good, 2), (later, 3)):
        sent = request.sender.sent
        assert [flags for _, flags in sent] == [0] * (len(sent) - 1) + [FINAL]
        assert not any(response.has_error() for response in request.sender.responses)
        assert sum(len(response.as_arrays()[OUTPUT_IDS]) for response, _ in sent) == n


def test_cancelled_mid_stream_gets_one_final_cancelled_error(
    llm_model: Any, pb_utils: ModuleType, prompt: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(response_writer, "CANCEL_CHECK_INTERVAL_S", 0.0)  # at every response
    # Every snapshot the writer reaches goes out: the request's few steps may all fall within
    # one 50 ms interval, whose latest snapshot would show it gone already.
    monkeypatch.setattr(response_writer, "STATS_INTERVAL_S", 0.0)
    request = greedy_request(prompt, 200, request_id="cancel-me")
    cancelled_before = pb_utils.metric("llm_cancelled_requests_total").value()

    def cancel_on_second(response: Any, flags: int) -> None:
        # Runs in the writer thread during the 2nd send: its next response asks Triton.
        if len(request.sender.sent) == 2:
            request.cancelled = True

    request.sender.on_send = cancel_on_second
    llm_model.execute([request])
    wait_final(request)
    llm_model.finalize()

    sent = request.sender.sent
    # What the engine generated before it saw the cancel still went out, merged.
    data = len(sent) - 1
    assert data >= 2
    tokens = sum(len(response.as_arrays()[OUTPUT_IDS]) for response, _ in sent[:data])
    assert tokens < 200
    assert [flags for _, flags in sent] == [0] * data + [FINAL]
    assert not any(response.has_error() for response, _ in sent[:data])
    error = sent[-1][0].error()
    assert error.code() == pb_utils.TritonError.CANCELLED
    assert "cancelled" in error.message()
    assert sent[-1][0].output_tensors() == []

    assert pb_utils.metric("llm_cancelled_requests_total").value() == cancelled_before + 1
    assert pb_utils.metric("llm_finished_requests_total").value() == 0
    active = pb_utils.metric("llm_active_sequences")
    assert active.history[-2:] == [1.0, 0.0]
    assert active.value() == 0


def test_a_cancel_request_ends_the_request_in_flight_with_its_id(
    llm_model: Any, pb_utils: ModuleType, prompt: np.ndarray
) -> None:
    target = greedy_request(prompt, 200, request_id="target")
    other = greedy_request(prompt, 12, request_id="other")
    streaming = threading.Event()
    target.sender.on_send = lambda response, flags: streaming.set()
    llm_model.execute([target, other])
    assert streaming.wait(WAIT_S)
    cancel = FakeRequest({CANCEL: np.array([True])}, request_id="target")
    unknown = FakeRequest({CANCEL: np.array([True])}, request_id="gone")
    llm_model.execute([cancel, unknown])
    wait_final(target, other, cancel, unknown)
    llm_model.finalize()

    # Each CANCEL request gets one empty final response, found or not.
    assert cancel.sender.sent == [(None, FINAL)]
    assert unknown.sender.sent == [(None, FINAL)]
    # The target's stream ends with its own FINAL, a CANCELLED error, long before 200 tokens.
    sent = target.sender.sent
    assert [flags for _, flags in sent] == [0] * (len(sent) - 1) + [FINAL]
    tokens = sum(len(response.as_arrays()[OUTPUT_IDS]) for response, _ in sent[:-1])
    assert tokens < 200
    assert sent[-1][0].error().code() == pb_utils.TritonError.CANCELLED
    # Not Triton's flag: the target's client cancelled nothing.
    assert not target.cancelled
    # The other request ran to its end.
    last = other.sender.sent[-1][0]
    assert not last.has_error()
    assert last.as_arrays()[COMPLETION_TOKENS].tolist() == [12]
    assert pb_utils.metric("llm_cancelled_requests_total").value() == 1


def test_a_cancel_request_needs_an_id_and_cancel_false_is_a_request(
    llm_model: Any, pb_utils: ModuleType, prompt: np.ndarray
) -> None:
    nameless = FakeRequest({CANCEL: np.array([True])}, request_id="")
    inputs = {tensor.name(): tensor.as_numpy() for tensor in greedy_request(prompt, 3).inputs()}
    ordinary = FakeRequest({**inputs, CANCEL: np.array([False])}, request_id="x")
    llm_model.execute([nameless, ordinary])
    wait_final(nameless, ordinary)

    [(response, flags)] = nameless.sender.sent
    assert flags == FINAL
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert response.error().message().startswith("CANCEL: needs the id of the request")
    assert ordinary.sender.sent[-1][0].as_arrays()[COMPLETION_TOKENS].tolist() == [3]


@pytest.mark.parametrize("decoupled", [False, None])
def test_initialize_refuses_a_non_decoupled_config(
    import_model: Callable[[str], ModuleType],
    model_args: Callable[..., dict[str, str]],
    pb_utils: ModuleType,
    decoupled: bool | None,
) -> None:
    before = engine_processes()
    model = import_model("llm").TritonPythonModel()
    with pytest.raises(pb_utils.TritonModelException, match=r"decoupled: true"):
        model.initialize(model_args("llm", decoupled=decoupled))
    assert engine_processes() == before


def test_finalize_stops_the_engine_and_ends_requests_in_flight(
    import_model: Callable[[str], ModuleType],
    model_args: Callable[..., dict[str, str]],
    pb_utils: ModuleType,
    prompt: np.ndarray,
) -> None:
    before = engine_processes()
    model = import_model("llm").TritonPythonModel()
    model.initialize(model_args("llm"))
    [engine] = engine_processes() - before

    request = greedy_request(prompt, 400, request_id="in-flight")
    streaming = threading.Event()
    request.sender.on_send = lambda response, flags: streaming.set()
    model.execute([request])
    assert streaming.wait(WAIT_S)
    model.finalize()

    assert not engine.is_alive()
    assert request.sender.final.is_set()
    assert request.sender.final_count == 1
    last, flags = request.sender.sent[-1]
    assert flags == FINAL
    assert last.error().code() == pb_utils.TritonError.UNAVAILABLE
    assert "shutting down" in last.error().message()
    assert len(request.sender.sent) < 400


def test_a_request_beyond_the_queue_limit_is_refused_as_unavailable(
    import_model: Callable[[str], ModuleType],
    model_args: Callable[..., dict[str, str]],
    pb_utils: ModuleType,
    prompt: np.ndarray,
) -> None:
    model = import_model("llm").TritonPythonModel()
    model.initialize(model_args("llm", max_num_seqs="1", max_queue_size="1"))
    try:
        running = greedy_request(prompt, 400, request_id="running")
        streaming = threading.Event()
        running.sender.on_send = lambda response, flags: streaming.set()
        model.execute([running])
        assert streaming.wait(WAIT_S)  # it holds the only slot from now on
        queued = greedy_request(prompt, 2, request_id="queued")
        refused = greedy_request(prompt, 2, request_id="refused")
        model.execute([queued, refused])

        wait_final(refused)  # at once, while the other two are still in flight
        [(response, flags)] = refused.sender.sent
        assert flags == FINAL
        assert response.error().code() == pb_utils.TritonError.UNAVAILABLE
        assert "server busy" in response.error().message()

        running.cancelled = True  # frees the slot: the queued request is served
        wait_final(running, queued)
        assert running.sender.responses[-1].error().code() == pb_utils.TritonError.CANCELLED
        assert queued.sender.sent[-1][1] == FINAL and queued.sender.final_count == 1
        assert not any(r.has_error() for r in queued.sender.responses)
        assert sum(len(r.as_arrays()[OUTPUT_IDS]) for r in queued.sender.responses) == 2
    finally:
        model.finalize()


@pytest.mark.parametrize("restarts", [None, "3"])
def test_the_server_restarts_the_launcher_counted_are_a_metric(
    import_model: Callable[[str], ModuleType],
    model_args: Callable[..., dict[str, str]],
    pb_utils: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    restarts: str | None,
) -> None:
    """The launcher passes its count in the environment (backend.supervisor); the counter
    starts there and outlives `initialize` (its family is kept alive)."""
    if restarts is not None:
        monkeypatch.setenv(RESTARTS_ENV, restarts)
    model = import_model("llm").TritonPythonModel()
    model.initialize(model_args("llm"))
    try:
        gc.collect()
        restarts_total = pb_utils.metric("llm_server_restarts_total", {"model": "llm"})
        assert restarts_total.value() == int(restarts or 0)
    finally:
        model.finalize()
