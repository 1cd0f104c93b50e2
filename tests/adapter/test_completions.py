"""/v1/completions formatting and streaming against a fake engine."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from adapter.completions.protocol import CompletionRequest
from adapter.completions.serving import OpenAIServingCompletion
from adapter.errors import EngineError, TritonInputError
from adapter.models import OpenAIServingModels
from adapter.tensors import TritonRequest
from backend import contract
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
    options = {"include_usage": True, "continuous_usage_stats": True}
    *chunks, last, _ = stream(client, stream_options=options)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    # Without include_usage no chunk has usage, as in vLLM.
    alone = stream(client, stream_options={"continuous_usage_stats": True})
    assert len(alone) == 3 and all("usage" not in c for c in alone[:-1])


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
        TritonInputError(
            contract.INPUT_IDS,
            "the prompt has 300 tokens, this model's maximum context length is 256 tokens",
        )
    ]
    response = client.post(URL, json={"model": "tiny", "prompt": "p", "stream": streamed})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "prompt: the prompt has 300 tokens, this model's maximum context length is "
        "256 tokens",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }


def test_vocabulary_error_names_logprob_token_ids(engine: FakeEngine, client: TestClient) -> None:
    engine.script = [
        TritonInputError(contract.LOGPROB_TOKEN_IDS, "id 70000 is outside the vocabulary")
    ]
    body = {"model": "tiny", "prompt": "p", "logprobs": 0, "logprob_token_ids": [70000]}
    response = client.post(URL, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logprob_token_ids"
    assert "outside the vocabulary" in response.json()["error"]["message"]


@pytest.mark.parametrize("n", [1, 3])
async def test_closing_the_stream_closes_the_triton_request(n: int) -> None:
    """What a client disconnect does: the SSE generator is closed mid-stream."""
    gate = asyncio.Event()  # never set: generation hangs after the first token
    engine = FakeEngine(script=[EURO_SCRIPT[0], gate, EURO_SCRIPT[2]])
    serving = OpenAIServingCompletion(engine, OpenAIServingModels(engine, None))
    lines = await serving.create_completion(CompletionRequest(prompt="p", stream=True, n=n))
    firsts = [await anext(lines) for _ in range(n)]  # each choice's first token
    assert all('"finish_reason":null' in first for first in firsts)
    task = asyncio.ensure_future(anext(lines))
    await asyncio.sleep(0)  # one turn of the loop: the task runs until it waits at the gate
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (engine.closed, engine.finished) == (n, 0)


# Prompt [7, 8, 9] = "a", "é" in two tokens: position i scores token i given the ones before.
PROMPT = [(7, b"a", 0.0), (8, b"\xc3", -1.0), (9, b"\xa9", -0.5)]
ECHO_SCRIPT = [
    output(
        tokens=[(12, b"!", -0.25)],
        top=[[(13, b"?", -0.125)]],
        prompt=PROMPT,
        prompt_top=[[(20, b"x", -0.75)], [(9, b"\xa9", -0.5)]],
        finish_reason="length",
        prompt_tokens=3,
        completion_tokens=1,
    )
]


def test_echo_puts_the_prompt_and_its_logprobs_first(
    engine: FakeEngine, client: TestClient
) -> None:
    engine.script = ECHO_SCRIPT
    body = {"model": "tiny", "prompt": [7, 8, 9], "echo": True, "logprobs": 1, "max_tokens": 1}
    choice = client.post(URL, json=body).json()["choices"][0]
    assert choice["text"] == "aé!"  # the prompt's bytes decoded, then the generated text
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["a", "\ufffd", "\ufffd", "!"]
    assert logprobs["token_logprobs"] == [None, -1.0, -0.5, -0.25]
    assert logprobs["text_offset"] == [0, 1, 1, 2]
    assert logprobs["top_logprobs"] == [
        None,  # the first prompt token has no logprob
        {"\ufffd": -1.0, "x": -0.75},  # the prompt token first, then the natural top-k
        {"\ufffd": -0.5},
        {"!": -0.25, "?": -0.125},
    ]
    params, _ = engine.requests[0]
    assert (params.prompt_logprobs, params.logprobs) == (1, 1)


def test_echo_of_a_text_prompt_without_generation(engine: FakeEngine, client: TestClient) -> None:
    engine.script = [output(finish_reason="length", prompt_tokens=5)]
    body = {"model": "tiny", "prompt": "Grüß", "echo": True, "max_tokens": 0}
    response = client.post(URL, json=body).json()
    assert response["choices"][0]["text"] == "Grüß"  # the request's own text
    assert response["choices"][0]["finish_reason"] == "length"
    assert response["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    assert engine.requests[0][0].prompt_logprobs is None  # nothing asked of the prompt


def test_echo_of_a_text_prompt_offsets_index_the_returned_text(
    engine: FakeEngine, client: TestClient
) -> None:
    """The prompt's tokens decode to "<s> Hi" (a BOS, SentencePiece's space) while the echo is
    the request's "Hi": the generated token's offset is where its text starts in the choice."""
    engine.script = [
        output(
            tokens=[(12, b" there", -0.25)],
            prompt=[(1, b"<s>", 0.0), (5, b" H", -1.0), (6, b"i", -0.5)],
            finish_reason="length",
            prompt_tokens=3,
            completion_tokens=1,
        )
    ]
    body = {"model": "tiny", "prompt": "Hi", "echo": True, "logprobs": 0, "max_tokens": 1}
    choice = client.post(URL, json=body).json()["choices"][0]
    assert choice["text"] == "Hi there"
    assert choice["logprobs"]["tokens"] == ["<s>", " H", "i", " there"]
    assert choice["logprobs"]["text_offset"] == [0, 2, 2, 2]
    assert choice["text"][2:] == " there"


def test_echo_streams_the_prompt_in_the_first_chunk(engine: FakeEngine, client: TestClient) -> None:
    prompt_output = output(
        tokens=[(12, b"!", -0.25)],
        top=[[(13, b"?", -0.125)]],
        prompt=PROMPT,
        prompt_top=[[(20, b"x", -0.75)], [(9, b"\xa9", -0.5)]],
        completion_tokens=1,
    )
    engine.script = [
        prompt_output,
        output(tokens=[(14, b".", -2.0)], top=[[(14, b".", -2.0)]], finish_reason="stop"),
    ]
    body = {"prompt": [7, 8, 9], "echo": True, "logprobs": 1}
    full = client.post(URL, json={"model": "tiny", **body}).json()["choices"][0]
    chunks = [c["choices"][0] for c in stream(client, **body)[:-1]]
    assert [c["text"] for c in chunks] == ["aé!", "."]
    assert [len(c["logprobs"]["tokens"]) for c in chunks] == [4, 1]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == full["logprobs"][key], key


SCORE_PROMPT = {"model": "tiny", "prompt": [7, 8, 9], "echo": True, "logprobs": 0, "max_tokens": 0}
"""Scores the prompt without generating."""


def test_prompt_logprob_token_ids_follow_the_prompt_token(
    engine: FakeEngine, client: TestClient
) -> None:
    main = output(
        prompt=PROMPT,
        prompt_requested=[[-3.0, -1.0], [-0.5, -6.0]],  # columns: ids 9, 65
        prompt_requested_bytes=[b"\t", b"A"],
        finish_reason="length",
    )
    engine.script = [main]
    body = {**SCORE_PROMPT, "prompt_logprob_token_ids": [9, 65, 9]}
    top = client.post(URL, json=body).json()["choices"][0]["logprobs"]["top_logprobs"]
    # The prompt token first, then each distinct requested id but it, in request order; the
    # requested ids' strings come from their bytes, PROMPT_LOGPROB_TOKEN_BYTES.
    assert [list(t.items()) if t else t for t in top] == [
        None,
        [("\ufffd", -1.0), ("\t", -3.0), ("A", -1.0)],
        [("\ufffd", -0.5), ("A", -6.0)],  # the prompt token is 9: once, first
    ]
    assert engine.detokenized == []  # no call for the ids' bytes: the response has them
    [(main_request, _)] = engine.requests
    assert main_request.prompt_logprob_token_ids == (9, 65)
    assert main_request.prompt_logprobs == 0


def test_prompt_logprob_token_ids_as_token_ids_need_no_bytes(
    engine: FakeEngine, client: TestClient
) -> None:
    engine.script = [
        output(
            prompt=PROMPT,
            prompt_requested=[[-3.0, -1.0], [-0.5, -6.0]],
            prompt_requested_bytes=[b"\t", b"A"],
            finish_reason="length",
        )
    ]
    body = {**SCORE_PROMPT, "prompt_logprob_token_ids": [9, 65], "return_tokens_as_token_ids": True}
    top = client.post(URL, json=body).json()["choices"][0]["logprobs"]["top_logprobs"]
    assert top == [
        None,
        {"token_id:8": -1.0, "token_id:9": -3.0, "token_id:65": -1.0},
        {"token_id:9": -0.5, "token_id:65": -6.0},  # the prompt token 9 once, first
    ]
    assert len(engine.requests) == 1


def test_a_batch_of_prompts_with_n_samples(engine: FakeEngine, client: TestClient) -> None:
    engine.script = [output(tokens=[(33, b"!", -1.0)], finish_reason="length", completion_tokens=1)]
    body = {"model": "tiny", "prompt": ["ab", "cde"], "n": 2, "seed": 5, "max_tokens": 1}
    response = client.post(URL, json=body).json()
    assert [c["index"] for c in response["choices"]] == [0, 1, 2, 3]
    sent = [(params.text, params.seed) for params, _ in engine.requests]
    assert sorted(sent) == [("ab", 5), ("ab", 6), ("cde", 5), ("cde", 6)]
    # Each prompt counts once (the fake reports 3 prompt tokens); every sample's tokens count.
    assert response["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}


TOO_LONG_AT_1 = "prompt: the prompt at index 1 has 64 tokens, this model's maximum context"


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize(
    ("prompts", "max_tokens", "param", "message"),
    [
        (["ab", "x" * 64, "ab"], 1, "prompt", TOO_LONG_AT_1),
        ([[1, 2], [7] * 64], 1, "prompt", TOO_LONG_AT_1),
        (["ab", "x" * 60], 8, "max_tokens", "`max_tokens` is too large: 8."),
    ],
)
def test_a_batch_with_one_prompt_too_long_starts_none(
    engine: FakeEngine,
    client: TestClient,
    prompts: list[str | list[int]],
    max_tokens: int,
    param: str,
    message: str,
    streamed: bool,
) -> None:
    """Every prompt is tokenized and checked before any runs, as vLLM does: the others do not
    generate only to be cancelled when the long one is refused (the fake's context is 64)."""
    engine.script = EXPLICIT_SCRIPT
    body = {"model": "tiny", "prompt": prompts, "max_tokens": max_tokens, "n": 2}
    error = client.post(URL, json={**body, "stream": streamed}).json()["error"]
    assert error["param"] == param and error["message"].startswith(message)
    assert engine.requests == []
    assert len(engine.tokenized) == len({p for p in prompts if isinstance(p, str)})  # once each
    body["prompt"] = ["ab", "x" * 50]
    response = client.post(URL, json={**body, "echo": True})
    texts = [c["text"] for c in response.json()["choices"]]
    assert texts == ["abaz", "abaz", "x" * 50 + "az", "x" * 50 + "az"]
    sent = [(params.text, params.prompt_ids) for params, _ in engine.requests]
    assert sorted(sent) == [("ab", (97, 98))] * 2 + [("x" * 50, (120,) * 50)] * 2


def test_of_several_refused_prompts_the_first_is_answered(
    engine: FakeEngine, client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whichever refusal arrives first, the request gets the first prompt's: here the second
    prompt's tokenizing fails before the first's does."""
    second_failed = asyncio.Event()

    async def tokenize(params: TritonRequest, request_id: str) -> list[int]:
        if params.text == "first":
            await second_failed.wait()
        else:
            second_failed.set()
        raise TritonInputError(contract.TEXT_INPUT, f"{params.text!r} is refused")

    monkeypatch.setattr(engine, "tokenize", tokenize)
    response = client.post(URL, json={"model": "tiny", "prompt": ["first", "second"]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["message"]) == ("prompt", "prompt: 'first' is refused")
    assert engine.requests == []


def test_n_streams_tag_each_chunk_with_its_choice(engine: FakeEngine, client: TestClient) -> None:
    engine.script = EXPLICIT_SCRIPT
    events = stream(client, n=3, stream_options={"include_usage": True})
    chunks, usage = events[:-2], events[-2]
    by_index: dict[int, list[str]] = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        by_index.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert by_index == {i: [None, "stop"] for i in range(3)}
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


@pytest.mark.parametrize("streamed", [False, True])
def test_one_failing_choice_fails_the_request_and_cancels_the_rest(
    engine: FakeEngine, client: TestClient, streamed: bool
) -> None:
    gate = asyncio.Event()  # never set: the healthy choices wait forever
    rejected = TritonInputError(contract.MIN_TOKENS, "must be in [0, MAX_TOKENS=2], got 3")
    engine.respond = lambda params: [rejected] if params.seed == 1 else [gate]
    body = {"model": "tiny", "prompt": "p", "n": 3, "seed": 0, "stream": streamed}
    response = client.post(URL, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "min_tokens"
    assert engine.closed == 3  # the waiting requests were cancelled, not left running


def test_the_default_max_tokens_near_the_context_end_is_not_refused(
    engine: FakeEngine, client: TestClient
) -> None:
    """OpenAI's default of 16 is not the caller's limit: the model stops at the context's end
    (the fake's is 64) instead of a 400 about a field the caller never sent (vLLM)."""
    engine.script = EXPLICIT_SCRIPT
    response = client.post(URL, json={"model": "tiny", "prompt": "x" * 60})
    assert response.status_code == 200, response.text
    [(params, _)] = engine.requests
    assert (params.max_tokens, params.max_tokens_parameter) == (16, None)
    refused = client.post(URL, json={"model": "tiny", "prompt": "x" * 60, "max_tokens": 16})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_max_tokens_null_generates_up_to_the_context_end(
    engine: FakeEngine, client: TestClient
) -> None:
    """An explicit null is no limit of the request's own, as in vLLM (the rest of the
    context), not OpenAI's default of 16 for an absent field; `min_tokens` above 16 is then
    no conflict."""
    engine.script = EXPLICIT_SCRIPT
    body = {"model": "tiny", "prompt": "p", "max_tokens": None, "min_tokens": 20}
    response = client.post(URL, json=body)
    assert response.status_code == 200, response.text
    [(params, _)] = engine.requests
    assert (params.max_tokens, params.max_tokens_parameter, params.min_tokens) == (64, None, 20)


@pytest.mark.parametrize("stop_reason", ["ok", 433, None])
def test_the_stop_reason_is_on_the_choice_and_on_its_last_chunk(
    engine: FakeEngine, client: TestClient, stop_reason: str | int | None
) -> None:
    """vLLM's `stop_reason`; only a request with stop rules asks Triton for STOP_REASON."""
    engine.script = [
        output(tokens=[(12, b"a", -0.5)], completion_tokens=1),
        output(tokens=[(30, b"z", -0.2)], finish_reason="stop", stop_reason=stop_reason),
    ]
    body = {"model": "tiny", "prompt": "p", "stop": ["ok"], "stop_token_ids": [433]}
    [choice] = client.post(URL, json=body).json()["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_reason)
    chunks = [e["choices"][0] for e in stream(client, stop=["ok"])[:-1]]
    assert [c["stop_reason"] for c in chunks] == [None, stop_reason]  # vLLM: on every chunk
    names = [params.output_names for params, _ in engine.requests]
    assert all(contract.STOP_REASON in n for n in names)
    client.post(URL, json={"model": "tiny", "prompt": "p"})
    assert contract.STOP_REASON not in engine.requests[-1][0].output_names
