"""The engine seam against a fake gRPC client: final flag, errors, cancellation, config."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from adapter import triton_client
from adapter.engine_client import ModelInfo
from adapter.errors import EngineError, EngineUnavailableError, TritonInputError
from adapter.tensors import TritonRequest
from adapter.triton_client import TritonEngineClient, error_from_triton
from backend import contract
from tests.adapter.fakes import response_arrays


class FakeResult:
    """The part of `tritonclient.grpc.InferResult` the engine reads."""

    def __init__(self, arrays: dict[str, np.ndarray], final: bool) -> None:
        self._arrays = arrays
        flag = SimpleNamespace(bool_param=final)
        self._response = SimpleNamespace(parameters={"triton_final_response": flag})

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self._arrays.get(name)

    def get_response(self) -> Any:
        return self._response


class FakeCall:
    """A `stream_infer` response iterator: plays (result, error) pairs, records cancel(); with
    a `gate`, the last pair waits for it."""

    def __init__(self, items: list[Any], gate: asyncio.Event | None = None) -> None:
        self._items = list(items)
        self._gate = gate
        self.cancelled = False

    def end_with(self, item: Any) -> None:
        """What the model does on a CANCEL: `item` is the request's last response."""
        self._items = [item]
        if self._gate is not None:
            self._gate.set()

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> Any:
        if self._gate is not None and len(self._items) == 1:
            await self._gate.wait()
        if not self._items:
            raise StopAsyncIteration
        return self._items.pop(0)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


CANCELLED = SimpleNamespace(message=lambda: "the request was cancelled")


class FakeClient:
    """`stream_infer` plays `call` and records the requests sent on it, a CANCEL ending it with
    a CANCELLED error unless `cancel_ends` is False (an `llm` without CANCEL); `infer`
    (preprocessing) returns `prompt_ids` or raises."""

    def __init__(
        self,
        call: FakeCall,
        prompt_ids: tuple[int, ...] | Exception = (1, 2, 3),
        cancel_ends: bool = True,
    ) -> None:
        self.call = call
        self.prompt_ids = prompt_ids
        self.cancel_ends = cancel_ends
        self.requests: list[dict[str, Any]] = []
        self.tokenized: list[tuple[str, list[str]]] = []

    async def infer(self, model: str, inputs: list[Any], request_id: str) -> FakeResult:
        self.tokenized.append((model, [i.name() for i in inputs]))
        if isinstance(self.prompt_ids, Exception):
            raise self.prompt_ids
        return FakeResult({contract.INPUT_IDS: np.array(self.prompt_ids, np.int32)}, final=True)

    def stream_infer(self, inputs_iterator: AsyncIterator[dict[str, Any]]) -> FakeCall:
        async def consume() -> None:
            async for request in inputs_iterator:
                self.requests.append(request)
                if self.cancel_ends and request["inputs"][0].name() == contract.CANCEL:
                    self.call.end_with((None, CANCELLED))

        self._task = asyncio.ensure_future(consume())
        return self.call

    async def get_model_config(self, model: str, client_timeout: float) -> Any:
        parameters = {
            "max_model_len": SimpleNamespace(string_value="0"),
            "max_logprobs": SimpleNamespace(string_value="7"),
            "model_path": SimpleNamespace(string_value="/cache/models/tiny-llama/"),
        }
        return SimpleNamespace(config=SimpleNamespace(parameters=parameters))

    async def is_server_ready(self, client_timeout: float) -> bool:
        return True

    async def is_model_ready(self, model: str, client_timeout: float) -> bool:
        return True

    async def close(self) -> None:
        """Nothing to release."""


def token(i: int, final: bool = False) -> tuple[FakeResult, None]:
    arrays = response_arrays(
        [(i, b"t", -0.5)], finish_reason="length" if final else "", completion_tokens=i
    )
    return FakeResult(arrays, final), None


_ENGINES: list[TritonEngineClient] = []


@pytest.fixture(autouse=True)
async def _close_engines() -> AsyncIterator[None]:
    """Each test's engines are closed after it, their replica watchers with them."""
    yield
    while _ENGINES:
        await _ENGINES.pop().close()


def engine_with(call: FakeCall, **kwargs: Any) -> tuple[TritonEngineClient, FakeClient]:
    client = FakeClient(call, **kwargs)
    engine = TritonEngineClient("unused:1", client=client)  # type: ignore[arg-type]
    _ENGINES.append(engine)
    return engine, client


async def test_stream_ends_at_the_final_response() -> None:
    call = FakeCall([token(1), token(2, final=True)])
    engine, client = engine_with(call)
    outputs = [o async for o in engine.generate(TritonRequest(text="hi"), "req-1")]
    assert [(o.output_ids, o.final, o.finish_reason) for o in outputs] == [
        ([1], False, None),
        ([2], True, "length"),
    ]
    assert not call.cancelled  # a finished request is not cancelled
    assert client.tokenized == [("preprocessing", [contract.TEXT_INPUT])]
    [request] = client.requests  # and gets no CANCEL
    # Its Triton id is the caller's, made unique (a CANCEL ends the request with its id).
    assert request["model_name"] == "llm"
    assert re.fullmatch(r"req-1\.[0-9a-f]{8}", request["request_id"])
    [prompt] = request["inputs"]
    assert (prompt.name(), prompt.shape()) == (
        contract.INPUT_IDS,
        [3],
    )  # the ids preprocessing made


async def test_token_prompts_skip_preprocessing() -> None:
    engine, client = engine_with(FakeCall([token(1, final=True)]))
    params = TritonRequest(prompt_ids=(3, 4), max_tokens=1)
    [out] = [o async for o in engine.generate(params, "r")]
    assert out.final
    assert client.tokenized == []
    assert [i.name() for i in client.requests[0]["inputs"]] == [
        contract.INPUT_IDS,
        contract.MAX_TOKENS,
    ]


async def test_preprocessing_errors_are_classified() -> None:
    rejected = InferenceServerException(
        "MESSAGES: each message needs a string `role`", status="StatusCode.INVALID_ARGUMENT"
    )
    engine, client = engine_with(FakeCall([]), prompt_ids=rejected)
    messages = ({"role": "user", "content": "x"},)
    with pytest.raises(TritonInputError) as info:
        _ = [o async for o in engine.generate(TritonRequest(messages=messages), "r")]
    assert info.value.tensor == contract.MESSAGES
    assert client.requests == []

    down = InferenceServerException("failed to connect", status="StatusCode.UNAVAILABLE")
    engine, _ = engine_with(FakeCall([]), prompt_ids=down)
    with pytest.raises(EngineUnavailableError):
        _ = [o async for o in engine.generate(TritonRequest(text="x"), "r")]


def assert_ended_by_a_cancel(client: FakeClient) -> None:
    """The stream's second request is a CANCEL with the first one's id, and the RPC was not
    cancelled: it ended with the request's final response."""
    request, cancel = client.requests
    assert [tensor.name() for tensor in cancel["inputs"]] == [contract.CANCEL]
    assert cancel["inputs"][0].shape() == [1]
    assert (cancel["model_name"], cancel["request_id"]) == ("llm", request["request_id"])
    assert not client.call.cancelled


async def test_closing_early_ends_the_request_with_a_cancel_on_its_stream() -> None:
    gate = asyncio.Event()  # set by the CANCEL alone: the second response never comes
    call = FakeCall([token(1), token(2, final=True)], gate=gate)
    engine, client = engine_with(call)
    async with aclosing(engine.generate(TritonRequest(text="hi"), "r")) as stream:
        first = await anext(stream)
        assert first.output_ids == [1]
    await engine.close()  # which waits for the stream's end (or cancels it, failing this test)
    assert_ended_by_a_cancel(client)


async def test_task_cancellation_ends_the_request_with_a_cancel_on_its_stream() -> None:
    gate = asyncio.Event()
    call = FakeCall([token(1), token(2, final=True)], gate=gate)
    engine, client = engine_with(call)
    seen: list[int] = []

    async def consume() -> None:
        async for out in engine.generate(TritonRequest(text="hi"), "r"):
            seen.extend(out.output_ids)

    task = asyncio.ensure_future(consume())
    while not seen:
        await asyncio.sleep(0)
    task.cancel()  # while it waits for the next response: grpc.aio would cancel that read
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.close()
    assert_ended_by_a_cancel(client)


@pytest.mark.parametrize("timeout", ["CANCEL_TIMEOUT_S", "CLOSE_WAIT_S"])
async def test_a_stream_that_does_not_end_after_its_cancel_is_cancelled(
    timeout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An `llm` without CANCEL keeps generating: after the bound, or at `close`, the RPC is
    cancelled after all."""
    monkeypatch.setattr(triton_client, timeout, 0.0)
    call = FakeCall([token(1), token(2, final=True)], gate=asyncio.Event())
    engine, client = engine_with(call, cancel_ends=False)
    async with aclosing(engine.generate(TritonRequest(text="hi"), "r")) as stream:
        await anext(stream)
    await engine.close()
    assert call.cancelled
    assert [r["inputs"][0].name() for r in client.requests] == [contract.INPUT_IDS, contract.CANCEL]


async def test_stream_error_is_classified() -> None:
    error = SimpleNamespace(message=lambda: "LOGPROB_TOKEN_IDS: id 70000 is outside the vocabulary")
    engine, client = engine_with(FakeCall([(None, error)]))
    with pytest.raises(TritonInputError) as info:
        _ = [o async for o in engine.generate(TritonRequest(text="hi"), "r")]
    assert (info.value.tensor, info.value.detail) == (
        contract.LOGPROB_TOKEN_IDS,
        "id 70000 is outside the vocabulary",
    )
    await engine.close()
    assert len(client.requests) == 1  # an error is a final response: nothing to cancel


async def test_stream_without_final_is_an_engine_error() -> None:
    engine, _ = engine_with(FakeCall([token(1)]))
    with pytest.raises(EngineError, match="before the final response"):
        _ = [o async for o in engine.generate(TritonRequest(text="hi"), "r")]


async def test_final_response_needs_a_reason() -> None:
    result = FakeResult(response_arrays([(1, b"t", -0.5)]), final=True)
    engine, _ = engine_with(FakeCall([(result, None)]))
    with pytest.raises(EngineError, match="without a reason"):
        _ = [o async for o in engine.generate(TritonRequest(text="hi"), "r")]


@pytest.mark.parametrize(
    ("message", "kind", "tensor"),
    [
        (
            "INPUT_IDS: the prompt has 5000 tokens, this model's maximum context length is "
            "2048 tokens",
            TritonInputError,
            contract.INPUT_IDS,
        ),
        (
            "[request id: cmpl-1] MAX_TOKENS: must be >= 0, got -1",
            TritonInputError,
            contract.MAX_TOKENS,
        ),
        ("MESSAGES: is not valid JSON", TritonInputError, contract.MESSAGES),
        (
            "in ensemble 'ensemble', LOGPROB_TOKEN_IDS: id 70000 is outside the vocabulary",
            TritonInputError,
            contract.LOGPROB_TOKEN_IDS,
        ),
        ("OUTPUT_IDS: something", EngineError, None),  # not an input: the model's own fault
        ("Request for unknown model: 'llm' is not found", EngineUnavailableError, None),
        ("server busy: 256 requests are waiting for a sequence slot", EngineUnavailableError, None),
        ("the engine process died", EngineUnavailableError, None),  # restarting: 503, retry
        ("the model is shutting down", EngineUnavailableError, None),
        ("unexpected shape for input 'SEED'", EngineError, None),
    ],
)
def test_error_from_triton(message: str, kind: type, tensor: str | None) -> None:
    error = error_from_triton(message)
    assert type(error) is kind
    if tensor is not None:
        assert error.tensor == tensor


async def test_model_info_is_read_once_from_the_config() -> None:
    engine, client = engine_with(FakeCall([]))
    info = await engine.model_info()
    assert info == ModelInfo(
        max_model_len=None,  # "0": the model's own context
        max_logprobs=7,
        max_logprob_token_ids=1024,
        model_path="/cache/models/tiny-llama/",
    )
    assert info.default_model_name == "tiny-llama"
    client.get_model_config = None  # type: ignore[assignment]  # a second read would fail
    assert await engine.model_info() is info


def test_model_info_defaults() -> None:
    info = ModelInfo.from_parameters({"max_model_len": "2048"})
    assert (info.max_model_len, info.max_logprobs, info.max_logprob_token_ids) == (2048, 20, 1024)
    assert info.default_model_name == "llm"
    assert (info.max_num_seqs, info.max_queue_size, info.max_requests_at_once) == (16, 256, 272)
    read = ModelInfo.from_parameters({"max_num_seqs": "4", "max_queue_size": "0"})
    assert read.max_requests_at_once == 4
