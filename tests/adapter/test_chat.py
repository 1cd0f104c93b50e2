"""/v1/chat/completions formatting and streaming against a fake engine."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient

from adapter import serving as serving_module
from adapter.chat.protocol import ChatCompletionRequest
from adapter.chat.serving import OpenAIServingChat
from adapter.errors import EngineError, TritonInputError
from adapter.models import OpenAIServingModels
from adapter.protocol import UsageInfo
from backend import contract
from tests.adapter.fakes import FakeEngine, output
from tests.adapter.sse import sse_payloads

URL = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]

TOP_SCRIPT = [
    output(
        tokens=[(10, b"\xc3", -0.5)],
        text="",
        top=[[(11, b"A", -0.25), (10, b"\xc3", -0.5)]],
        completion_tokens=1,
    ),
    output(
        tokens=[(12, b"\xa9", -0.125)],
        text="é",
        top=[[(12, b"\xa9", -0.125), (14, b"B", -3.0)]],
        finish_reason="stop",
        prompt_tokens=6,
        completion_tokens=2,
    ),
]

# Requested ids [5, 7, 5] reach the model as the distinct (5, 7).
EXPLICIT_SCRIPT = [
    output(
        tokens=[(7, b"yes", -0.25)],
        requested=[[-2.0, -0.25]],
        requested_bytes=[b"no", b"yes"],
        completion_tokens=1,
    ),
    output(
        tokens=[(9, b".", -0.5)],
        requested=[[-4.0, -9999.0]],
        finish_reason="length",
        completion_tokens=2,
    ),
]


def entry(token: str, logprob: float, raw: bytes) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(raw)}


def test_top_logprobs_with_real_bytes(engine: FakeEngine, client: TestClient) -> None:
    engine.script = TOP_SCRIPT
    body = {"model": "tiny", "messages": MESSAGES, "logprobs": True, "top_logprobs": 2}
    response = client.post(URL, json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["object"] == "chat.completion"
    choice = result["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "é"}
    assert choice["finish_reason"] == "stop"
    assert result["usage"] == {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
    assert choice["logprobs"]["content"] == [
        {
            **entry("\ufffd", -0.5, b"\xc3"),  # half of "é": the bytes say which half
            "top_logprobs": [entry("A", -0.25, b"A"), entry("\ufffd", -0.5, b"\xc3")],
        },
        {
            **entry("\ufffd", -0.125, b"\xa9"),
            "top_logprobs": [entry("\ufffd", -0.125, b"\xa9"), entry("B", -3.0, b"B")],
        },
    ]
    params, _ = engine.requests[0]
    assert params.messages == ({"role": "user", "content": "Hi"},)
    assert (params.add_generation_prompt, params.continue_final_message) == (True, False)
    assert params.logprobs == 2
    assert params.max_tokens == 64  # the fake's context: chat has no default limit


def test_logprobs_without_top_logprobs(engine: FakeEngine, client: TestClient) -> None:
    engine.script = [  # LOGPROBS = 0: k = 0 alternatives
        output(tokens=[(10, b"a", -0.5)], completion_tokens=1),
        output(tokens=[(11, b"b", -0.25)], finish_reason="stop", completion_tokens=2),
    ]
    response = client.post(URL, json={"model": "tiny", "messages": MESSAGES, "logprobs": True})
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert [c["top_logprobs"] for c in content] == [[], []]
    assert engine.requests[0][0].logprobs == 0


def test_explicit_ids_sampled_first_without_duplicates(
    engine: FakeEngine, client: TestClient
) -> None:
    engine.script = EXPLICIT_SCRIPT
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "logprobs": True,
        "top_logprobs": 3,
        "logprob_token_ids": [5, 7, 5],
    }
    response = client.post(URL, json=body)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert [[t["token"] for t in c["top_logprobs"]] for c in content] == [
        ["yes", "no"],  # the sampled id 7 is requested too: once, first
        [".", "no", "yes"],
    ]
    assert content[1]["top_logprobs"][2] == entry("yes", -9999.0, b"yes")
    params, _ = engine.requests[0]
    assert (params.logprob_token_ids, params.logprobs) == ((5, 7), 0)


def test_tokens_as_token_ids(engine: FakeEngine, client: TestClient) -> None:
    engine.script = EXPLICIT_SCRIPT
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "logprobs": True,
        "logprob_token_ids": [5],
        "return_tokens_as_token_ids": True,
    }
    engine.script = [
        output(
            tokens=[(7, b"yes", -0.25)],
            requested=[[-2.0]],
            requested_bytes=[b"no"],
            finish_reason="stop",
            completion_tokens=1,
        )
    ]
    content = client.post(URL, json=body).json()["choices"][0]["logprobs"]["content"]
    assert content == [
        {
            **entry("token_id:7", -0.25, b"yes"),
            "top_logprobs": [entry("token_id:7", -0.25, b"yes"), entry("token_id:5", -2.0, b"no")],
        }
    ]


def stream(client: TestClient, **fields: object) -> list:
    body = {"model": "tiny", "messages": MESSAGES, "stream": True, **fields}
    with client.stream("POST", URL, json=body) as response:
        assert response.status_code == 200
        return sse_payloads(response.read().decode())


def test_stream_role_first_then_deltas(engine: FakeEngine, client: TestClient) -> None:
    engine.script = EXPLICIT_SCRIPT
    body = {"logprobs": True, "logprob_token_ids": [5, 7]}
    full = client.post(URL, json={"model": "tiny", "messages": MESSAGES, **body}).json()
    events = stream(client, **body, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    role, *chunks, usage = events[:-1]
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    choices = [c["choices"][0] for c in chunks]
    assert [c["delta"] for c in choices] == [{"content": "yes"}, {"content": "."}]
    assert [c["finish_reason"] for c in choices] == [None, "length"]
    joined = [e for c in choices for e in c["logprobs"]["content"]]
    assert joined == full["choices"][0]["logprobs"]["content"]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_stream_token_without_text_still_carries_logprobs(
    engine: FakeEngine, client: TestClient
) -> None:
    engine.script = TOP_SCRIPT
    events = stream(client, logprobs=True)
    first = events[1]["choices"][0]
    assert first["delta"] == {"content": ""}
    assert [e["bytes"] for e in first["logprobs"]["content"]] == [[0xC3]]


def test_final_response_without_tokens_closes_with_empty_delta(
    engine: FakeEngine, client: TestClient
) -> None:
    engine.script = [
        output(tokens=[(1, b"a", -0.5)], completion_tokens=1),
        output(finish_reason="stop", completion_tokens=1),
    ]
    chunks = stream(client)[1:-1]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "a"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]


def test_error_mid_stream_is_an_error_event_then_done(
    engine: FakeEngine, client: TestClient
) -> None:
    engine.script = [EXPLICIT_SCRIPT[0], EngineError("boom")]
    events = stream(client)
    assert [type(e).__name__ for e in events] == ["dict", "dict", "dict", "str"]
    assert events[2]["error"]["message"] == "boom"
    assert events[2]["error"]["type"] == "server_error"
    assert all(c["choices"][0]["finish_reason"] is None for c in events[:2])


@pytest.mark.parametrize("streamed", [False, True])
def test_too_long_chat_prompt_names_messages(
    engine: FakeEngine, client: TestClient, streamed: bool
) -> None:
    engine.script = [
        TritonInputError(
            contract.INPUT_IDS,
            "the prompt has 300 tokens, this model's maximum context length is 256 tokens",
        )
    ]
    response = client.post(URL, json={"model": "tiny", "messages": MESSAGES, "stream": streamed})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"


async def test_cancelling_the_stream_closes_the_triton_request() -> None:
    gate = asyncio.Event()
    engine = FakeEngine(script=[EXPLICIT_SCRIPT[0], gate, EXPLICIT_SCRIPT[1]])
    serving = OpenAIServingChat(engine, OpenAIServingModels(engine, None))
    lines = await serving.create_chat_completion(
        ChatCompletionRequest(messages=MESSAGES, stream=True)
    )
    assert '"role":"assistant"' in await anext(lines)
    assert '"content":"yes"' in await anext(lines)
    await lines.aclose()
    assert (engine.closed, engine.finished) == (1, 0)


ASSISTANT_PREFIX = [*MESSAGES, {"role": "assistant", "content": "Sure:"}]


def test_echo_puts_the_assistant_prefix_before_the_reply(
    engine: FakeEngine, client: TestClient
) -> None:
    engine.script = EXPLICIT_SCRIPT
    body = {"model": "tiny", "messages": ASSISTANT_PREFIX, "echo": True}
    assert client.post(URL, json=body).json()["choices"][0]["message"]["content"] == "Sure:yes."
    body["messages"] = MESSAGES  # the last message is the user's: nothing to echo (vLLM)
    assert client.post(URL, json=body).json()["choices"][0]["message"]["content"] == "yes."


def test_echo_streams_the_prefix_after_the_role(engine: FakeEngine, client: TestClient) -> None:
    engine.script = EXPLICIT_SCRIPT
    events = stream(client, messages=ASSISTANT_PREFIX, echo=True)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "Sure:"},
        {"content": "yes"},
        {"content": "."},
    ]


def test_a_reply_that_continues_the_last_message_takes_its_role(
    engine: FakeEngine, client: TestClient
) -> None:
    """Without a generation prompt the model continues the last message, so the reply has its
    role and `echo` repeats it, whoever wrote it (vLLM's `get_chat_request_role`)."""
    engine.script = EXPLICIT_SCRIPT
    body = {"model": "tiny", "messages": MESSAGES, "echo": True, "add_generation_prompt": False}
    message = client.post(URL, json=body).json()["choices"][0]["message"]
    assert message == {"role": "user", "content": "Hiyes."}
    events = stream(client, messages=MESSAGES, echo=True, add_generation_prompt=False)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[:2] == [{"role": "user", "content": ""}, {"content": "Hi"}]
    body["add_generation_prompt"] = None  # the default: a new assistant message
    message = client.post(URL, json=body).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "yes."}


def test_continuous_usage_starts_with_the_prompt_on_the_lead_chunks(
    engine: FakeEngine, client: TestClient
) -> None:
    """The role and echo chunks carry the prompt's usage with no completion yet (vLLM)."""
    engine.script = EXPLICIT_SCRIPT
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = stream(client, messages=ASSISTANT_PREFIX, echo=True, stream_options=options)
    usage = [(e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"]) for e in events[:-1]]
    assert usage == [(3, 0), (3, 0), (3, 1), (3, 2), (3, 2)]  # the last: include_usage's


def test_n_choices_stream_with_their_index(engine: FakeEngine, client: TestClient) -> None:
    engine.script = EXPLICIT_SCRIPT
    body = {"n": 2, "seed": 7, "logprobs": True, "stream_options": {"include_usage": True}}
    events = stream(client, **body)
    *chunks, usage, _ = events
    roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1]  # a role chunk per choice comes first
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[2:] if c["choices"][0]["index"] == index]
        assert [c["delta"] for c in mine] == [{"content": "yes"}, {"content": "."}]
        assert [c["finish_reason"] for c in mine] == [None, "length"]
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert sorted(params.seed for params, _ in engine.requests) == [7, 8]

    full = client.post(URL, json={"model": "tiny", "messages": MESSAGES, "n": 2}).json()
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in full["choices"]] == ["yes.", "yes."]


def test_the_full_response_is_built_off_the_event_loop(
    engine: FakeEngine, client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A response with many explicit ids takes seconds to build: not on the loop that serves
    every other request (`OpenAIServing.collect_all`)."""
    threads: dict[str, threading.Thread] = {}
    collect_all, build = (
        OpenAIServingChat.collect_all,
        OpenAIServingChat.chat_completion_full_response,
    )

    async def collecting(*args: Any) -> Any:
        threads["loop"] = threading.current_thread()
        return await collect_all(*args)

    def building(*args: Any) -> Any:
        threads["build"] = threading.current_thread()
        return build(*args)

    monkeypatch.setattr(OpenAIServingChat, "collect_all", collecting)
    monkeypatch.setattr(OpenAIServingChat, "chat_completion_full_response", staticmethod(building))
    engine.script = EXPLICIT_SCRIPT
    response = client.post(URL, json={"model": "tiny", "messages": MESSAGES})
    assert response.json()["choices"][0]["message"]["content"] == "yes."
    assert threads["build"] is not threads["loop"]


@pytest.mark.parametrize(("threshold", "one_at_a_time"), [(0, True), (10**9, False)])
async def test_large_full_responses_are_built_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch, threshold: int, one_at_a_time: bool
) -> None:
    """Their memory would add up (`LARGE_RESPONSE_ENTRIES`); small ones go at once. The JSON
    is made in the same worker thread."""
    monkeypatch.setattr(serving_module, "LARGE_RESPONSE_ENTRIES", threshold)
    serving = chat_serving()
    held: list[bool] = []

    def build() -> UsageInfo:
        held.append(serving._large_builds.locked())
        return UsageInfo.from_counts(3, 2)

    body = await serving.build_full_response(build, [EXPLICIT_SCRIPT])
    assert json.loads(body.text) == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert held == [one_at_a_time]


async def test_a_large_build_holds_its_turn_until_its_thread_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Also when its client left: the thread still holds the response's memory."""
    monkeypatch.setattr(serving_module, "LARGE_RESPONSE_ENTRIES", 0)
    serving = chat_serving()
    started, release = threading.Event(), threading.Event()

    def build() -> UsageInfo:
        started.set()
        release.wait()
        return UsageInfo.from_counts(3, 2)

    task = asyncio.create_task(serving.build_full_response(build, [EXPLICIT_SCRIPT]))
    try:
        await asyncio.to_thread(started.wait)
        task.cancel()
        for _ in range(5):  # the cancel reaches the task: it no longer awaits the thread
            await asyncio.sleep(0)
        assert serving._large_builds.locked()
    finally:
        release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not serving._large_builds.locked()


def test_prompt_logprobs_count_toward_a_large_response() -> None:
    """An echoed prompt scored against 1024 ids is as large as 1024 ids generated."""
    prompt = [(7, b"a", 0.0), (8, b"b", -1.0), (9, b"c", -0.5)]
    echo = output(prompt=prompt, prompt_requested=[[-1.0] * 4, [-2.0] * 4])
    assert serving_module._logprob_entries([[echo]]) == 3 + 2 * 4


def chat_serving() -> OpenAIServingChat:
    engine = FakeEngine()
    return OpenAIServingChat(engine, OpenAIServingModels(engine, None))


def test_the_stop_reason_is_on_the_choice_and_on_its_last_chunk(
    engine: FakeEngine, client: TestClient
) -> None:
    engine.script = [
        output(tokens=[(12, b"a", -0.5)], completion_tokens=1),
        output(tokens=[(30, b"z", -0.2)], finish_reason="stop", stop_reason="z!"),
    ]
    body = {"model": "tiny", "messages": MESSAGES, "stop": "z!"}
    [choice] = client.post(URL, json=body).json()["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "z!")
    chunks = [e["choices"][0] for e in stream(client, stop="z!")[:-1]]
    assert [c.get("stop_reason", "unset") for c in chunks] == ["unset", "unset", "z!"]
