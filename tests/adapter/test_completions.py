"""/v1/completions formatting and streaming against a fake engine."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from adapter.completions.protocol import CompletionRequest
from adapter.completions.serving import OpenAIServingCompletion
from adapter.errors import EngineError, TritonInputError
from adapter.models import OpenAIServingModels
from backend import triton_io as io
from tests.adapter.fakes import FakeEngine, output
from tests.adapter.sse import sse_payloads

URL = "/v1/completions"

# "€" is b"\xe2\x82\xac": the first token holds only part of it.
EURO_SCRIPT = [
    output(
        tokens=[(10, b"\xe2\x82", -0.5)],
        text="",
        top=[[(11, b"A", -0.25), (10, b"\xe2\x82", -0.5)]],
        completion_tokens=1,
    ),
    output(
        tokens=[(12, b"\xac", -0.125), (13, b" ok", -1.0)],
        text="€ ok",
        top=[[(12, b"\xac", -0.125), (14, b"B", -3.0)], [(15, b"C", -0.75), (13, b" ok", -1.0)]],
        completion_tokens=3,
    ),
    output(
        tokens=[(16, b"!", -2.0)],
        top=[[(16, b"!", -2.0), (17, b"?", -2.5)]],
        finish_reason="length",
        prompt_tokens=4,
        completion_tokens=4,
    ),
]

# Requested ids [12, 20, 12, 13] reach the model as the distinct (12, 20, 13).
EXPLICIT_SCRIPT = [
    output(
        tokens=[(12, b"a", -0.5)],
        requested=[[-0.5, -7.0, -2.0]],
        requested_bytes=[b"a", b"\xff", b"c"],
        completion_tokens=1,
    ),
    output(
        tokens=[(30, b"z", -0.25)],
        requested=[[-3.0, -9999.0, -1.5]],
        finish_reason="stop",
        completion_tokens=2,
    ),
]


def test_natural_logprobs_put_the_sampled_token_first(
    engine: FakeEngine, client: TestClient
) -> None:
    engine.script = EURO_SCRIPT
    response = client.post(URL, json={"model": "tiny", "prompt": "p", "logprobs": 2})
    assert response.status_code == 200
    body = response.json()
    choice = body["choices"][0]
    assert choice["text"] == "€ ok!"
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["\ufffd", "\ufffd", " ok", "!"]
    assert logprobs["token_logprobs"] == [-0.5, -0.125, -1.0, -2.0]
    # Character offsets in the text: the partial token and its completion both start "€".
    assert logprobs["text_offset"] == [0, 0, 1, 4]
    assert [list(d.items()) for d in logprobs["top_logprobs"]] == [
        [("\ufffd", -0.5), ("A", -0.25)],  # sampled, then top-k; the sampled one not twice
        [("\ufffd", -0.125), ("B", -3.0)],
        [(" ok", -1.0), ("C", -0.75)],
        [("!", -2.0), ("?", -2.5)],
    ]
    params, _ = engine.requests[0]
    assert (params.text, params.logprobs, params.max_tokens) == ("p", 2, 16)


def test_explicit_ids_sampled_first_then_each_distinct_id(
    engine: FakeEngine, client: TestClient
) -> None:
    engine.script = EXPLICIT_SCRIPT
    body = {
        "model": "tiny",
        "prompt": [1, 2],
        "logprobs": 5,
        "logprob_token_ids": [12, 20, 12, 13],
        "return_tokens_as_token_ids": True,
    }
    response = client.post(URL, json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:12", "token_id:30"]
    assert [list(d.items()) for d in logprobs["top_logprobs"]] == [
        # The sampled id 12 is also requested: once, at the front.
        [("token_id:12", -0.5), ("token_id:20", -7.0), ("token_id:13", -2.0)],
        [
            ("token_id:30", -0.25),
            ("token_id:12", -3.0),
            ("token_id:20", -9999.0),
            ("token_id:13", -1.5),
        ],
    ]
    params, _ = engine.requests[0]
    assert params.prompt_ids == (1, 2)
    assert params.logprob_token_ids == (12, 20, 13)
    assert params.logprobs == 0


def stream(client: TestClient, **fields: object) -> list:
    body = {"model": "tiny", "prompt": "p", "stream": True, **fields}
    with client.stream("POST", URL, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_payloads(response.read().decode())


def test_stream_deltas_join_to_the_full_response(engine: FakeEngine, client: TestClient) -> None:
    engine.script = EURO_SCRIPT
    full = client.post(URL, json={"model": "tiny", "prompt": "p", "logprobs": 2}).json()
    events = stream(client, logprobs=2, stream_options={"include_usage": True})
    chunks, usage, done = events[:-2], events[-2], events[-1]
    assert done == "[DONE]"
    assert len(chunks) == 3
    assert {c["id"] for c in chunks} == {usage["id"]}
    assert all(c["object"] == "text_completion" for c in chunks)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons == [None, None, "length"]  # once, on the last choice chunk
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == full["choices"][0]["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        joined = [v for c in choices for v in c["logprobs"][key]]
        assert joined == full["choices"][0]["logprobs"][key], key
    assert choices[1]["logprobs"]["text_offset"] == [0, 1]  # continues across chunks
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


def test_stream_without_usage_or_logprobs(engine: FakeEngine, client: TestClient) -> None:
    engine.script = EXPLICIT_SCRIPT
    events = stream(client)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["choices"][0]["logprobs"] for c in chunks] == [None, None]
    assert all("usage" not in c for c in chunks)


def test_stream_continuous_usage(engine: FakeEngine, client: TestClient) -> None:
    engine.script = EXPLICIT_SCRIPT
    events = stream(client, stream_options={"continuous_usage_stats": True})
    assert [c["usage"]["completion_tokens"] for c in events[:-1]] == [1, 2]


def test_error_mid_stream_is_an_error_event_then_done(
    engine: FakeEngine, client: TestClient
) -> None:
    engine.script = [EURO_SCRIPT[0], EngineError("the engine thread died")]
    events = stream(client)
    assert len(events) == 3
    assert events[0]["choices"][0]["finish_reason"] is None
    assert events[1] == {
        "error": {
            "message": "the engine thread died",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    assert events[2] == "[DONE]"


@pytest.mark.parametrize("streamed", [False, True])
def test_model_input_errors_are_400_before_any_stream(
    engine: FakeEngine, client: TestClient, streamed: bool
) -> None:
    engine.script = [
        TritonInputError(io.INPUT_IDS, "the prompt has 300 tokens, the context holds 256")
    ]
    response = client.post(URL, json={"model": "tiny", "prompt": "p", "stream": streamed})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "prompt: the prompt has 300 tokens, the context holds 256",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }


def test_vocabulary_error_names_logprob_token_ids(engine: FakeEngine, client: TestClient) -> None:
    engine.script = [TritonInputError(io.LOGPROB_TOKEN_IDS, "id 70000 is outside the vocabulary")]
    body = {"model": "tiny", "prompt": "p", "logprobs": 0, "logprob_token_ids": [70000]}
    response = client.post(URL, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logprob_token_ids"
    assert "outside the vocabulary" in response.json()["error"]["message"]


async def test_closing_the_stream_closes_the_triton_request() -> None:
    """What a client disconnect does: the SSE generator is closed mid-stream."""
    gate = asyncio.Event()  # never set: generation hangs after the first token
    engine = FakeEngine(script=[EURO_SCRIPT[0], gate, EURO_SCRIPT[2]])
    serving = OpenAIServingCompletion(engine, OpenAIServingModels(engine, None))
    lines = await serving.create_completion(CompletionRequest(prompt="p", stream=True))
    first = await anext(lines)
    assert '"finish_reason":null' in first
    task = asyncio.ensure_future(anext(lines))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (engine.closed, engine.finished) == (1, 0)
