"""Every 400 / 404 through the real adapter: OpenAI error objects naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.openai_support import MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
TOO_LONG_TEXT = "hello " * 300  # more tokens than the test server's 256-token context


def completion(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


def chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}


CASES = [
    # logprob_token_ids rules (docs/design.md, "Logprob semantics")
    (COMPLETIONS, completion(logprobs=0, logprob_token_ids=[]), "logprob_token_ids", "empty"),
    (CHAT, chat(logprob_token_ids=[1]), "logprob_token_ids", "requires `logprobs: true`"),
    (COMPLETIONS, completion(logprob_token_ids=[1]), "logprob_token_ids", "requires `logprobs`"),
    (
        COMPLETIONS,
        completion(logprobs=0, logprob_token_ids=[1], echo=True, max_tokens=0),
        "logprob_token_ids",
        "`echo: true` and `max_tokens: 0`",
    ),
    (
        CHAT,
        chat(logprobs=True, logprob_token_ids=[1], use_beam_search=True),
        "logprob_token_ids",
        "beam search",
    ),
    (
        COMPLETIONS,
        completion(logprobs=0, logprob_token_ids=[1, 1024]),
        "logprob_token_ids",
        "id 1024 is outside the vocabulary [0, 1024)",
    ),
    (
        CHAT,
        chat(logprobs=True, logprob_token_ids=[70000], stream=True),
        "logprob_token_ids",
        "id 70000 is outside the vocabulary [0, 1024)",
    ),
    (
        CHAT,
        chat(logprobs=True, logprob_token_ids=list(range(1025))),
        "logprob_token_ids",
        "at most 1024",
    ),
    (
        COMPLETIONS,
        completion(logprobs=0, logprob_token_ids=[1, "2"]),
        "logprob_token_ids",
        "integer token ids",
    ),
    # standard rules
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", "at most 20"),
    (COMPLETIONS, completion(logprobs=21), "logprobs", "at most 20"),
    (CHAT, chat(top_logprobs=2), "top_logprobs", "requires `logprobs: true`"),
    (COMPLETIONS, completion(max_tokens=-1), "max_tokens", "greater than or equal to 0"),
    (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens", "greater than or equal"),
    (
        COMPLETIONS,
        completion(prompt=TOO_LONG_TEXT),
        "prompt",
        "this model's maximum context length is 256 tokens",
    ),
    (
        COMPLETIONS,
        completion(prompt=["hi", TOO_LONG_TEXT]),  # checked in the adapter, before "hi" runs
        "prompt",
        "prompt: the prompt at index 1 has 901 tokens, this model's maximum context length is 256",
    ),
    (
        COMPLETIONS,
        completion(prompt=[5] * 300, stream=True),
        "prompt",
        "this model's maximum context length is 256 tokens",
    ),
    (
        COMPLETIONS,
        completion(prompt=[[5], [5] * 300], n=2),
        "prompt",
        "this model's maximum context length is 256 tokens",
    ),
    # the prompt and the token limit beyond the context (vLLM's and OpenAI's 400, not a cut)
    (COMPLETIONS, completion(prompt=[5] * 10, max_tokens=247), "max_tokens", "(247 > 256 - 10)"),
    (COMPLETIONS, completion(max_tokens=256, stream=True), "max_tokens", "is too large: 256"),
    (CHAT, chat(max_completion_tokens=256), "max_completion_tokens", "is too large: 256"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": TOO_LONG_TEXT}]),
        "messages",
        "this model's maximum context length is 256 tokens",
    ),
    # min_tokens beyond what the context leaves the reply (vLLM: at most max_tokens, which
    # it cuts to that room), where no max_tokens is given
    (
        CHAT,
        chat(messages=[{"role": "user", "content": "a " * 100}], max_tokens=None, min_tokens=300),
        "min_tokens",
        "must be at most the",
    ),
    (
        COMPLETIONS,
        completion(prompt=[5] * 250, max_tokens=None, min_tokens=7),
        "min_tokens",
        "at most the 6 tokens",
    ),
    (COMPLETIONS, completion(prompt=["a", [1]]), "prompt", "integer token ids"),
    # sampling fields: the adapter's bounds, and the model's (vocabulary) through Triton
    (COMPLETIONS, completion(n=0), "n", "greater than or equal to 1"),
    (CHAT, chat(logit_bias={"x": 5}), "logit_bias", "keys must be token ids"),
    (CHAT, chat(logit_bias={"5": 101}), "logit_bias", "less than or equal to 100"),
    (COMPLETIONS, completion(logit_bias={"5000": 1}), "logit_bias", "outside the vocabulary"),
    (CHAT, chat(allowed_token_ids=[3, 4096]), "allowed_token_ids", "outside the vocabulary"),
    (COMPLETIONS, completion(allowed_token_ids=[]), "allowed_token_ids", "must not be empty"),
    (CHAT, chat(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
    (COMPLETIONS, completion(frequency_penalty=-3), "frequency_penalty", "greater than or equal"),
    (CHAT, chat(repetition_penalty=0), "repetition_penalty", "greater than 0"),
    (COMPLETIONS, completion(min_tokens=3), "min_tokens", "at most the token limit (2)"),
    (COMPLETIONS, completion(stop_token_ids=[9999]), "stop_token_ids", "outside the vocabulary"),
    (CHAT, chat(stop=[f"s{i}" for i in range(65)]), "stop", "holds 65 strings, at most 64"),
    # prompt_logprob_token_ids (completions; our extension)
    (
        COMPLETIONS,
        completion(logprobs=0, prompt_logprob_token_ids=[1]),
        "prompt_logprob_token_ids",
        "requires `echo: true`",
    ),
    (
        COMPLETIONS,
        completion(echo=True, logprobs=0, max_tokens=0, prompt_logprob_token_ids=[1, 2000]),
        "prompt_logprob_token_ids",
        "id 2000 is outside the vocabulary [0, 1024)",
    ),
    (
        COMPLETIONS,
        completion(
            echo=True,
            logprobs=0,
            prompt_logprob_token_ids=[2000],
            return_tokens_as_token_ids=True,
        ),
        "prompt_logprob_token_ids",
        "id 2000 is outside the vocabulary",
    ),
    (CHAT, chat(prompt_logprob_token_ids=[1]), "prompt_logprob_token_ids", "not supported"),
    # not supported
    (COMPLETIONS, completion(best_of=3), "best_of", "not supported"),
    (COMPLETIONS, completion(suffix="x"), "suffix", "not supported"),
    (COMPLETIONS, completion(prompt_logprobs=1), "prompt_logprobs", "not supported"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "not supported"),
    (CHAT, chat(functions=[{"name": "f"}]), "functions", "not supported"),
    (CHAT, chat(tool_choice="required"), "tool_choice", "not supported"),
    (CHAT, chat(guided_regex="[0-9]+"), "guided_regex", "not supported"),
    # /tokenize, /detokenize, /generative_scoring
    ("/tokenize", {"model": MODEL}, "prompt", "exactly one of `prompt` and `messages`"),
    ("/detokenize", {"tokens": [1, 5000]}, "tokens", "id 5000 is outside the vocabulary"),
    (
        "/generative_scoring",
        {"query": "a", "items": ["b"], "label_token_ids": [5000]},
        "label_token_ids",
        "id 5000 is outside the vocabulary",
    ),
    (
        "/generative_scoring",
        {"query": "a", "items": ["b"], "labels": ["no", "yes"]},
        "labels",
        "'yes' is 2 tokens [91, 302], not one",
    ),
    (
        "/generative_scoring",
        {"query": "a", "items": ["b"], "labels": ["x", "x"]},
        "labels",
        "both token 90",
    ),
    (
        "/generative_scoring",
        {"query": "a", "items": ["b", TOO_LONG_TEXT], "label_token_ids": [1]},
        "items[1]",
        "this model's maximum context length is 256 tokens",
    ),
    (
        "/generative_scoring",
        {"query": [5, 4000], "items": ["b"], "label_token_ids": [1]},
        "query",
        "id 4000 is outside the vocabulary",
    ),
    (
        "/generative_scoring",
        {"query": TOO_LONG_TEXT, "items": ["b"], "label_token_ids": [1]},
        "query",
        "this model's maximum context length is 256 tokens",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), CASES)
def test_bad_requests_are_400(
    http: httpx.Client, path: str, body: dict, param: str, message: str
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"  # also for stream: true
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message in error["message"]


def test_sdk_raises_bad_request_with_the_param(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            logprobs=True,
            extra_body={"logprob_token_ids": [2000]},
        )
    assert info.value.status_code == 400
    assert info.value.param == "logprob_token_ids"


def test_unknown_model_is_404(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.completions.create(model="gpt-4o", prompt="Hi")
    assert info.value.code == "model_not_found"


def test_server_still_answers_after_errors(http: httpx.Client) -> None:
    for _ in range(3):
        assert http.post(COMPLETIONS, json=completion(logprobs=99)).status_code == 400
    response = http.post(COMPLETIONS, json=completion(max_tokens=3, ignore_eos=True))
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3
