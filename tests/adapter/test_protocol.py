"""Request validation: every rule's 400 (message and `param`), and request -> params."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from adapter.chat.protocol import ChatCompletionRequest
from adapter.completions.protocol import CompletionRequest
from adapter.protocol import INT32_MAX, MAX_NESTING
from adapter.tokenize.protocol import TokenizeRequest
from tests.adapter.fakes import FakeEngine, output

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]


def completion(**fields: object) -> dict[str, object]:
    return {"model": "tiny", "prompt": "Hello", **fields}


def chat(**fields: object) -> dict[str, object]:
    return {"model": "tiny", "messages": MESSAGES, **fields}


def nested(depth: int) -> list:
    """`depth` lists, each in the one before."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


DEEP = f"`chat_template_kwargs` nests lists and objects more than {MAX_NESTING} levels deep."


@pytest.fixture(autouse=True)
def _one_token(engine: FakeEngine) -> None:
    engine.script = [
        output(
            tokens=[(7, b"!", -0.5)],
            requested=[[-1.0, -2.0]],
            requested_bytes=[b"a", b"b"],
            finish_reason="length",
            completion_tokens=1,
        )
    ]


def assert_400(client: TestClient, path: str, body: dict, param: str | None, message: str) -> None:
    """`body` as ASCII JSON, where a lone surrogate is an escape (the client's `json=` encodes
    UTF-8, which cannot hold one)."""
    content = json.dumps(body).encode()
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message in error["message"]


LOGPROB_TOKEN_IDS_CASES = [
    (COMPLETIONS, completion(logprobs=0, logprob_token_ids=[]), "must not be empty"),
    (COMPLETIONS, completion(logprob_token_ids=[1]), "requires `logprobs` (0 allowed)"),
    (
        COMPLETIONS,
        completion(logprobs=0, logprob_token_ids=[1], echo=True, max_tokens=0),
        "`echo: true` and `max_tokens: 0`",
    ),
    (COMPLETIONS, completion(logprobs=0, logprob_token_ids=[1], use_beam_search=True), "beam"),
    (COMPLETIONS, completion(logprobs=0, logprob_token_ids=[1, 2.5]), "integer token ids, got 2.5"),
    (COMPLETIONS, completion(logprobs=0, logprob_token_ids=["3"]), "integer token ids, got '3'"),
    (COMPLETIONS, completion(logprobs=0, logprob_token_ids=[True]), "integer token ids, got True"),
    (COMPLETIONS, completion(logprobs=0, logprob_token_ids=[-1]), "id -1 is outside the vocab"),
    (COMPLETIONS, completion(logprobs=0, logprob_token_ids=[2**31]), "outside the vocabulary"),
    (COMPLETIONS, completion(logprobs=0, logprob_token_ids=7), "must be a list of token ids"),
    (COMPLETIONS, completion(logprobs=0, logprob_token_ids=list(range(9))), "at most 8"),
    (CHAT, chat(logprob_token_ids=[1]), "requires `logprobs: true`"),
    (CHAT, chat(logprobs=False, logprob_token_ids=[1]), "requires `logprobs: true`"),
    (CHAT, chat(logprobs=True, logprob_token_ids=[]), "must not be empty"),
    (CHAT, chat(logprobs=True, logprob_token_ids=[1], use_beam_search=True), "beam search"),
    (CHAT, chat(logprobs=True, logprob_token_ids=[0.5]), "integer token ids"),
    (CHAT, chat(logprobs=True, logprob_token_ids=list(range(9))), "9 ids; at most 8"),
]


@pytest.mark.parametrize(("path", "body", "message"), LOGPROB_TOKEN_IDS_CASES)
def test_logprob_token_ids_rules(client: TestClient, path: str, body: dict, message: str) -> None:
    assert_400(client, path, body, "logprob_token_ids", message)


STANDARD_CASES = [
    (COMPLETIONS, completion(logprobs=6), "logprobs", "must be at most 5 (got 6)"),
    (COMPLETIONS, completion(logprobs=-1), "logprobs", "greater than or equal to 0"),
    (COMPLETIONS, completion(max_tokens=-1), "max_tokens", "greater than or equal to 0"),
    (COMPLETIONS, completion(prompt=[]), "prompt", "must not be empty"),
    (COMPLETIONS, completion(prompt=[1, "a"]), "prompt", "integer token ids"),
    (COMPLETIONS, completion(prompt=["a", [1]]), "prompt", "integer token ids, got 'a'"),
    (COMPLETIONS, completion(prompt=[[1], []]), "prompt", "an empty token-id list"),
    (COMPLETIONS, completion(prompt=[[1], [2.0]]), "prompt", "integer token ids, got 2.0"),
    (COMPLETIONS, completion(prompt={"a": 1}), "prompt", "a string or a list of token ids"),
    (COMPLETIONS, completion(n=0), "n", "greater than or equal to 1"),
    (CHAT, chat(n=129), "n", "less than or equal to 128"),
    (COMPLETIONS, completion(logit_bias={"x": 1}), "logit_bias", "keys must be token ids"),
    (CHAT, chat(logit_bias={"-3": 1}), "logit_bias", "keys must be token ids, got '-3'"),
    (CHAT, chat(logit_bias={"5": 101}), "logit_bias", "less than or equal to 100"),
    (COMPLETIONS, completion(presence_penalty=2.5), "presence_penalty", "less than or equal"),
    (CHAT, chat(frequency_penalty=-3), "frequency_penalty", "greater than or equal to -2"),
    (COMPLETIONS, completion(repetition_penalty=0), "repetition_penalty", "greater than 0"),
    (COMPLETIONS, completion(min_tokens=-1), "min_tokens", "greater than or equal to 0"),
    (CHAT, chat(min_p=1.5), "min_p", "less than or equal to 1"),
    (COMPLETIONS, completion(min_tokens=20), "min_tokens", "at most the token limit (16)"),
    (CHAT, chat(min_tokens=3, max_completion_tokens=2), "min_tokens", "token limit (2)"),
    (CHAT, chat(allowed_token_ids=[]), "allowed_token_ids", "must not be empty"),
    (COMPLETIONS, completion(allowed_token_ids=["1"]), "allowed_token_ids", "integer token ids"),
    (COMPLETIONS, completion(stop_token_ids=[-2]), "stop_token_ids", "outside the vocabulary"),
    (CHAT, chat(seed=2**63), "seed", "less than or equal to"),
    (COMPLETIONS, completion(temperature=-0.5), "temperature", "greater than or equal to 0"),
    (COMPLETIONS, completion(top_p=0), "top_p", "greater than 0"),
    (COMPLETIONS, completion(stop=["x", ""]), "stop", "must not be empty"),
    (COMPLETIONS, completion(stream_options={"include_usage": True}), "stream_options", "stream"),
    (CHAT, chat(top_logprobs=2), "top_logprobs", "requires `logprobs: true`"),
    (CHAT, chat(logprobs=True, top_logprobs=6), "top_logprobs", "must be at most 5 (got 6)"),
    (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens", "greater than or equal"),
    (CHAT, chat(max_tokens=-1), "max_tokens", "greater than or equal to 0"),
    (
        CHAT,
        chat(max_tokens=0),
        "max_tokens",
        "`max_tokens` must be at least 1 (0 only with `echo`)",
    ),
    (CHAT, chat(max_completion_tokens=0), "max_completion_tokens", "must be at least 1"),
    (CHAT, chat(messages=[]), "messages", "at least 1 item"),
    (CHAT, chat(messages=[{"role": "tool", "content": "x"}]), "messages", "role `tool`"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages",
        "Invalid message: only text content parts",
    ),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "input_text", "text": 5}]}]),
        "messages",
        "Invalid message: a content part of type 'input_text' needs its 'text' as a string.",
    ),
    (
        CHAT,
        chat(messages=[{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]),
        "messages",
        "`messages.tool_calls` is not supported",
    ),
    (CHAT, chat(messages=[{"content": "x"}]), "messages", "messages.0.role: Field required"),
    # Beyond the int32 and float32 tensors' range: a 400, not a wrapped or infinite value.
    (COMPLETIONS, completion(top_k=2**32 + 1), "top_k", "less than or equal to 2147483647"),
    (CHAT, chat(min_tokens=2**32 + 5), "min_tokens", "less than or equal to 2147483647"),
    (
        COMPLETIONS,
        completion(temperature=1e39),
        "temperature",
        "at most 3.402823e+38 (a float32); got 1e+39",
    ),
    (CHAT, chat(repetition_penalty=1e39), "repetition_penalty", "at most 3.402823e+38"),
    # The prompt and the token limit exceed the context (64; "Hello": 5 tokens in the fake).
    (
        COMPLETIONS,
        completion(max_tokens=60),
        "max_tokens",
        "`max_tokens` is too large: 60. This model's maximum context length is 64 tokens and "
        "your request has 5 input tokens (60 > 64 - 5).",
    ),
    (COMPLETIONS, completion(max_tokens=60, stream=True), "max_tokens", "is too large: 60"),
    (CHAT, chat(max_completion_tokens=60), "max_completion_tokens", "is too large: 60"),
    (CHAT, chat(max_tokens=60, stream=True), "max_tokens", "is too large: 60"),
    # JSON may escape a lone surrogate; no UTF-8 text holds one.
    (COMPLETIONS, completion(prompt="a\ud800b"), "prompt", "`prompt` holds a lone UTF-16"),
    (COMPLETIONS, completion(prompt=["ok", "\udfff"]), "prompt", "`prompt.1` holds a lone"),
    (COMPLETIONS, completion(stop=["\ud800"]), "stop", "`stop.0` holds a lone UTF-16"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": "\ud800"}]),
        "messages",
        "messages.0.content",
    ),
    (CHAT, chat(user="\udc00x"), "user", "`user` holds a lone UTF-16 surrogate"),
    (CHAT, chat(**{"x\udc00": 1}), "x\\udc00", "`x\\udc00` holds a lone UTF-16 surrogate"),
    # Deeper than MAX_NESTING: a later walk (json.dumps for Triton, the template's) would 500.
    *(
        (CHAT, chat(chat_template_kwargs={"x": nested(depth)}), "chat_template_kwargs", DEEP)
        for depth in (MAX_NESTING - 1, 500)
    ),
    (COMPLETIONS, completion(prompt=nested(MAX_NESTING)), "prompt", "`prompt` nests lists"),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), STANDARD_CASES)
def test_standard_rules(
    client: TestClient, path: str, body: dict, param: str, message: str
) -> None:
    assert_400(client, path, body, param, message)


PROMPT_LOGPROB_TOKEN_IDS_CASES = [
    (completion(echo=True, logprobs=0, prompt_logprob_token_ids=[]), "must not be empty"),
    (completion(logprobs=0, prompt_logprob_token_ids=[1]), "requires `echo: true` and `logprobs`"),
    (completion(echo=True, prompt_logprob_token_ids=[1]), "requires `echo: true` and `logprobs`"),
    (completion(echo=True, logprobs=0, prompt_logprob_token_ids=[1, "2"]), "integer token ids"),
    (completion(echo=True, logprobs=0, prompt_logprob_token_ids=list(range(9))), "at most 8"),
]


@pytest.mark.parametrize(("body", "message"), PROMPT_LOGPROB_TOKEN_IDS_CASES)
def test_prompt_logprob_token_ids_rules(client: TestClient, body: dict, message: str) -> None:
    assert_400(client, COMPLETIONS, body, "prompt_logprob_token_ids", message)


UNSUPPORTED_CASES = [
    (COMPLETIONS, completion(best_of=2), "best_of"),
    (COMPLETIONS, completion(suffix="!"), "suffix"),
    (COMPLETIONS, completion(use_beam_search=True), "use_beam_search"),
    (COMPLETIONS, completion(length_penalty=0.5), "length_penalty"),
    (COMPLETIONS, completion(prompt_logprobs=1), "prompt_logprobs"),
    (COMPLETIONS, completion(guided_json={"type": "object"}), "guided_json"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (CHAT, chat(functions=[{"name": "f"}]), "functions"),
    (CHAT, chat(function_call="auto"), "function_call"),
    (CHAT, chat(tool_choice="auto"), "tool_choice"),
    (CHAT, chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (CHAT, chat(prompt_logprob_token_ids=[1]), "prompt_logprob_token_ids"),
    (CHAT, chat(best_of=2), "best_of"),
]


@pytest.mark.parametrize(("path", "body", "param"), UNSUPPORTED_CASES)
def test_unsupported_fields_are_rejected(
    client: TestClient, path: str, body: dict, param: str
) -> None:
    assert_400(client, path, body, param, f"`{param}` is not supported by this server")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, completion(n=1, best_of=1, echo=False, logit_bias={}, presence_penalty=0)),
        (COMPLETIONS, completion(logprobs=0, logprob_token_ids=[3, 4], user="u", seed=3)),
        (COMPLETIONS, completion(prompt=["one prompt in a batch"], min_p=0)),
        (COMPLETIONS, completion(prompt=[[1, 2, 3]], skip_special_tokens=True)),
        (CHAT, chat(spaces_between_special_tokens=False)),
        (CHAT, chat(tools=[], tool_choice="none", response_format={"type": "text"})),
        (CHAT, chat(logprobs=True, top_logprobs=0, metadata={"k": "v"}, store=False)),
        (CHAT, chat(logprobs=True, top_logprobs=5, logprob_token_ids=[1, 2])),
    ],
)
def test_neutral_values_are_accepted(client: TestClient, path: str, body: dict) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, completion(max_tokens=59)),  # 5 prompt tokens + 59 = the context, 64
        (CHAT, chat()),  # no limit of its own: the model stops at the context's end
    ],
)
def test_a_token_limit_up_to_the_context_is_accepted(
    client: TestClient, engine: FakeEngine, path: str, body: dict
) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    [(params, _)] = engine.requests
    assert params.max_tokens == 59 if path == COMPLETIONS else 64


@pytest.mark.parametrize(
    ("path", "body", "param", "fits"),
    [
        (COMPLETIONS, completion(n=4), "n", {"n": 3}),
        (COMPLETIONS, completion(prompt=["a", "b"], n=2), "prompt", {"n": 1}),
        (COMPLETIONS, completion(prompt=[[1], [2], [3], [4]]), "prompt", {"prompt": [[1], [2]]}),
        (CHAT, chat(n=4, stream=True), "n", {"n": 3}),
    ],
)
def test_more_model_requests_than_the_engine_holds_are_400(
    client: TestClient, engine: FakeEngine, path: str, body: dict, param: str, fits: dict
) -> None:
    """A "server busy" 503 would come back on every retry."""
    engine.info = replace(engine.info, max_num_seqs=2, max_queue_size=1)
    assert_400(client, path, body, param, f"`{param}` makes 4 model requests; at most 3 fit")
    assert engine.requests == []
    assert client.post(path, json={**body, **fits}).status_code == 200


def test_unknown_harmless_fields_are_accepted_and_logged(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="adapter.protocol"):
        response = client.post(COMPLETIONS, json=completion(brand_new_field=1))
    assert response.status_code == 200
    assert "ignoring unknown fields ['brand_new_field']" in caplog.text


def test_invalid_json_is_400(client: TestClient) -> None:
    response = client.post(
        COMPLETIONS, content=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "The request body is not a valid JSON object."


def test_missing_prompt_names_it(client: TestClient) -> None:
    assert_400(client, COMPLETIONS, {"model": "tiny"}, "prompt", "prompt: Field required")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_unknown_model_is_404(client: TestClient, path: str) -> None:
    body = completion(model="gpt-4") if path == COMPLETIONS else chat(model="gpt-4")
    response = client.post(path, json=body)
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "The model `gpt-4` does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_completion_request_to_generation_params() -> None:
    [params] = CompletionRequest(
        prompt=[[5, 6, 7]], logprobs=3, logprob_token_ids=[9, 4, 9, 2], top_k=-1, stop="\n"
    ).to_generation_params(None)
    assert params.prompt_ids == (5, 6, 7)
    assert params.text is None
    assert params.max_tokens == 16  # OpenAI's completions default
    assert params.top_k == 0
    assert params.stop == ("\n",)
    assert params.logprobs == 0  # the natural top-k is not computed when ids are explicit
    assert params.logprob_token_ids == (9, 4, 2)
    assert params.prompt_logprobs is None  # no echo: the prompt's logprobs are not computed

    [text] = CompletionRequest(
        prompt="Hi",
        max_tokens=3,
        temperature=0,
        top_p=0.5,
        top_k=4,
        min_p=0.25,
        seed=11,
        ignore_eos=True,
        stop=["a", "b"],
        stop_token_ids=[2],
        logprobs=2,
        add_special_tokens=False,
    ).to_generation_params(None)
    assert (text.text, text.prompt_ids, text.max_tokens) == ("Hi", None, 3)
    assert (text.temperature, text.top_p, text.top_k, text.seed) == (0, 0.5, 4, 11)
    assert text.min_p == 0.25
    assert (text.ignore_eos, text.stop, text.stop_token_ids) == (True, ("a", "b"), (2,))
    assert (text.logprobs, text.logprob_token_ids, text.add_special_tokens) == (2, (), False)
    assert CompletionRequest(prompt="Hi").to_generation_params(None)[0].logprobs is None


def test_sampling_fields_reach_the_params_of_both_endpoints() -> None:
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": -1.5,
        "repetition_penalty": 1.25,
        "logit_bias": {"7": 100, "03": -5.5},
        "allowed_token_ids": [3, 7, 9],
        "min_tokens": 2,
        "include_stop_str_in_output": True,
        "max_tokens": 8,
    }
    [completion_params] = CompletionRequest(prompt="Hi", **fields).to_generation_params(None)
    [chat_params] = ChatCompletionRequest(messages=MESSAGES, **fields).to_generation_params(256)
    for params in (completion_params, chat_params):
        assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.5)
        assert params.repetition_penalty == 1.25
        assert params.logit_bias == ((7, 100.0), (3, -5.5))  # keys parsed as ids
        assert params.allowed_token_ids == (3, 7, 9)
        assert (params.min_tokens, params.include_stop_str_in_output) == (2, True)
        assert params.max_tokens == 8


def test_n_samples_get_consecutive_seeds() -> None:
    request = CompletionRequest(prompt=["a", "b"], n=3, seed=2**63 - 2)
    choices = request.to_generation_params(None)
    # Choice i*n + j is prompt i's sample j; seed + j wraps inside int64.
    assert [c.text for c in choices] == ["a", "a", "a", "b", "b", "b"]
    assert [c.seed for c in choices] == [2**63 - 2, 2**63 - 1, -(2**63)] * 2
    unseeded = ChatCompletionRequest(messages=MESSAGES, n=2).to_generation_params(256)
    assert [c.seed for c in unseeded] == [None, None]  # each draws its own random seed


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"prompt": "Hi", "echo": True}, None),  # the request's text is echoed
        ({"prompt": [4, 5], "echo": True}, 0),  # bytes of the ids are needed for the text
        ({"prompt": "Hi", "echo": True, "logprobs": 3}, 3),  # natural top-3 at prompt positions
        ({"prompt": "Hi", "logprobs": 3}, None),  # no echo: no prompt logprobs
        (
            {"prompt": "Hi", "echo": True, "logprobs": 3, "prompt_logprob_token_ids": [8, 8, 2]},
            0,  # explicit ids replace the natural top-k at prompt positions
        ),
        ({"prompt": "Hi", "echo": True, "logprobs": 3, "logprob_token_ids": [1]}, 3),
    ],
)
def test_echo_asks_for_prompt_logprobs_when_needed(fields: dict, expected: int | None) -> None:
    [params] = CompletionRequest(**fields).to_generation_params(None)
    assert params.prompt_logprobs == expected
    assert params.prompt_logprob_token_ids == (
        (8, 2) if "prompt_logprob_token_ids" in fields else ()
    )


def test_chat_request_to_generation_params() -> None:
    request = ChatCompletionRequest(
        messages=[
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "name": "bot"},
        ],
        max_tokens=9,
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=3,
    )
    [params] = request.to_generation_params(default_max_tokens=256)
    assert params.messages == (
        {"role": "system", "content": "Be brief."},
        # Parts stay parts: `preprocessing` joins them, or not, for the model's template.
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [], "name": "bot"},
    )
    assert params.max_tokens == 4  # max_completion_tokens wins
    assert params.logprobs == 3

    plain = ChatCompletionRequest(messages=MESSAGES)
    assert plain.to_generation_params(default_max_tokens=256)[0].max_tokens == 256
    assert plain.to_generation_params(default_max_tokens=None)[0].max_tokens == INT32_MAX
    assert plain.to_generation_params(default_max_tokens=256)[0].logprobs is None

    [explicit] = ChatCompletionRequest(
        messages=MESSAGES, logprobs=True, top_logprobs=5, logprob_token_ids=[3, 3, 1]
    ).to_generation_params(default_max_tokens=256)
    assert (explicit.logprobs, explicit.logprob_token_ids) == (0, (3, 1))
    [logprobs_only] = ChatCompletionRequest(messages=MESSAGES, logprobs=True).to_generation_params(
        default_max_tokens=256
    )
    assert logprobs_only.logprobs == 0


def test_chat_messages_carry_vllm_s_text_parts_and_an_assistant_s_reasoning() -> None:
    """vLLM reads `input_text`, `output_text`, `refusal` and `thinking` parts as text, skips
    null text, and passes an assistant's reasoning to the template under both names."""
    request = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": [{"type": "input_text", "text": "q"}], "reasoning": "r"},
            {
                "role": "assistant",
                "content": [{"type": "refusal", "refusal": "no"}, {"type": "text", "text": None}],
                "reasoning_content": "because",
            },
            {"role": "assistant", "content": "a", "reasoning": "so", "reasoning_content": "x"},
        ],
        echo=True,
    )
    [params] = request.to_generation_params(default_max_tokens=256)
    assert params.messages == (
        {"role": "user", "content": [{"type": "text", "text": "q"}]},  # only an assistant's
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "no"}],
            "reasoning": "because",
            "reasoning_content": "because",
        },
        {"role": "assistant", "content": "a", "reasoning": "so", "reasoning_content": "so"},
    )
    assert request.echo_text() == "a"


def test_chat_template_kwargs_reach_the_template_s_request() -> None:
    kwargs = {"enable_thinking": False}
    chat = ChatCompletionRequest(messages=MESSAGES, chat_template_kwargs=kwargs)
    [params] = chat.to_generation_params(default_max_tokens=256)
    assert params.chat_template_kwargs == kwargs
    tokenize = TokenizeRequest(messages=MESSAGES, chat_template_kwargs=kwargs)
    assert tokenize.to_generation_params().chat_template_kwargs == kwargs
    empty = ChatCompletionRequest(messages=MESSAGES, chat_template_kwargs={})
    assert empty.to_generation_params(default_max_tokens=256)[0].chat_template_kwargs is None


def test_a_body_nested_to_the_limit_is_served(client: TestClient, engine: FakeEngine) -> None:
    """MAX_NESTING levels, the body's own included, pass (one more is a 400 above)."""
    kwargs = {"x": nested(MAX_NESTING - 2)}
    response = client.post(CHAT, json=chat(chat_template_kwargs=kwargs))
    assert response.status_code == 200, response.text
    [(params, _)] = engine.requests
    assert params.chat_template_kwargs == kwargs
