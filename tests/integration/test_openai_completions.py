"""/v1/completions through the real adapter and tritonserver, with the openai SDK and httpx."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types import Completion

from backend import contract
from tests.integration.openai_support import (
    MODEL,
    assert_near_reference,
    distinct,
    sse_events,
    text_prompt_ids,
    token_id,
    triton_direct,
)

PROMPT = "Triton serves the model"  # the start of the passage the test model learnt


def test_logprobs_equal_triton_and_the_reference(
    openai_client: openai.OpenAI, triton_server, model_dir
) -> None:
    response = openai_client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"return_tokens_as_token_ids": True},
    )
    direct = triton_direct(triton_server.grpc_url, text=PROMPT, max_tokens=12, logprobs=3)
    choice = response.choices[0]
    ids = [token_id(t) for t in choice.logprobs.tokens]
    assert ids == direct.token_ids
    assert choice.text == direct.text
    assert choice.finish_reason == direct.finish_reason == "length"
    assert choice.logprobs.token_logprobs == direct.cat(contract.OUTPUT_LOGPROBS).tolist()
    top_ids = direct.cat(contract.TOP_LOGPROB_IDS).tolist()
    top_values = direct.cat(contract.TOP_LOGPROBS).tolist()
    for i, top in enumerate(choice.logprobs.top_logprobs):
        # The sampled token first, then the natural top 3 (the sampled one not twice).
        expected = {ids[i]: choice.logprobs.token_logprobs[i]}
        for token, value in zip(top_ids[i], top_values[i], strict=True):
            expected.setdefault(token, value)
        assert [(token_id(k), v) for k, v in top.items()] == list(expected.items())
    prompt_ids = text_prompt_ids(model_dir, PROMPT)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == len(prompt_ids) + 12
    positions = [{token_id(k): v for k, v in top.items()} for top in choice.logprobs.top_logprobs]
    assert_near_reference(model_dir, prompt_ids, ids, positions)


def test_logprob_token_ids_sampled_first_then_each_requested_id(
    http: httpx.Client, triton_server, model_dir
) -> None:
    greedy = triton_direct(triton_server.grpc_url, text=PROMPT, max_tokens=6)
    # A duplicate, an id of the padded vocabulary and the first sampled token.
    requested = [17, greedy.token_ids[0], 1010, 17, 400]
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 5,  # the natural count is ignored when ids are given
        "logprob_token_ids": requested,
        "return_tokens_as_token_ids": True,
    }
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    logprobs = Completion.model_validate(response.json()).choices[0].logprobs
    ids = [token_id(t) for t in logprobs.tokens]
    assert ids == greedy.token_ids
    direct = triton_direct(
        triton_server.grpc_url,
        text=PROMPT,
        max_tokens=6,
        logprobs=0,
        logprob_token_ids=distinct(requested),
    )
    columns = direct.cat(contract.LOGPROB_TOKEN_LOGPROBS).tolist()
    positions = []
    for i, top in enumerate(logprobs.top_logprobs):
        keys = [token_id(k) for k in top]
        assert keys == [ids[i]] + [t for t in distinct(requested) if t != ids[i]]
        assert len(keys) == len(set(keys))
        assert next(iter(top.values())) == logprobs.token_logprobs[i]
        for column, token in enumerate(distinct(requested)):
            assert top[f"token_id:{token}"] == columns[i][column]
        positions.append(dict(zip(keys, top.values(), strict=True)))
    assert positions[0].keys() == {greedy.token_ids[0], 17, 1010, 400}  # sampled id once
    assert_near_reference(model_dir, text_prompt_ids(model_dir, PROMPT), ids, positions)


async def test_stream_joins_to_the_full_response(
    async_openai_client: openai.AsyncOpenAI,
) -> None:
    request = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": 2,
        "extra_body": {"logprob_token_ids": [3, 30, 3, 300], "return_tokens_as_token_ids": True},
    }
    full = await async_openai_client.completions.create(**request)
    stream = await async_openai_client.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    *choice_chunks, usage_chunk = chunks
    assert usage_chunk.choices == []
    assert usage_chunk.usage == full.usage
    assert all(len(c.choices) == 1 for c in choice_chunks)
    reasons = [c.choices[0].finish_reason for c in choice_chunks]
    assert reasons[-1] == full.choices[0].finish_reason
    assert [r for r in reasons if r is not None] == [reasons[-1]]  # exactly one, the last
    choices = [c.choices[0] for c in choice_chunks]
    assert "".join(c.text for c in choices) == full.choices[0].text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        joined = [v for c in choices for v in getattr(c.logprobs, key)]
        assert joined == getattr(full.choices[0].logprobs, key), key
    assert len({c.id for c in chunks}) == 1
    for choice in choices:  # each delta carries the full set: sampled first, then the ids
        for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs, strict=True):
            sampled = token_id(token)
            assert [token_id(k) for k in top] == [sampled] + [
                t for t in (3, 30, 300) if t != sampled
            ]
            assert all(-9999.0 < v <= 0 for v in top.values())


def test_token_id_prompt_equals_the_text_prompt(openai_client: openai.OpenAI, model_dir) -> None:
    request = {"model": MODEL, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    text = openai_client.completions.create(prompt=PROMPT, **request)
    ids = openai_client.completions.create(prompt=text_prompt_ids(model_dir, PROMPT), **request)
    assert ids.choices[0].text == text.choices[0].text
    assert ids.choices[0].logprobs == text.choices[0].logprobs
    assert ids.usage == text.usage


def test_text_offset_points_into_the_text(openai_client: openai.OpenAI) -> None:
    # The passage goes on with CJK text: some characters take more than one token.
    prompt = "Triton serves the model and streams every token."
    response = openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=0
    )
    choice = response.choices[0]
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[0] == 0
    for token, offset in zip(tokens, offsets, strict=True):
        if "\ufffd" not in token:  # a whole-character token sits at its offset in the text
            assert choice.text[offset : offset + len(token)] == token
    assert [len(d) for d in choice.logprobs.top_logprobs] == [1] * len(tokens)  # logprobs=0


def test_stop_string_ends_generation(openai_client: openai.OpenAI) -> None:
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    free = openai_client.completions.create(**request).choices[0].text
    stop = free[6:9]
    stopped = openai_client.completions.create(**request, stop=[stop, "never"])
    assert stopped.choices[0].text == free[: free.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].stop_reason == stop  # type: ignore[attr-defined]  # vLLM's field


def test_max_tokens_ends_with_length(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 7, "ignore_eos": True, "seed": 3}
    response = http.post("/v1/completions", json=body).json()
    assert response["choices"][0]["finish_reason"] == "length"
    assert response["usage"]["completion_tokens"] == 7


def test_sse_lines_and_sdk_parsing(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 0,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(response.iter_lines()))
    chunks = events[:-1]
    # A chunk carries every token Triton merged into one response: one or more.
    tokens = [c["choices"][0]["logprobs"]["tokens"] for c in chunks]
    assert all(tokens) and sum(map(len, tokens)) == 5
    for chunk in chunks:
        logprobs = chunk["choices"][0]["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"])
        assert len(logprobs["text_offset"]) == len(logprobs["tokens"])
    last = Completion.model_validate(chunks[-1])  # finish_reason is set: strict parse works
    assert last.choices[0].finish_reason == "length"


@pytest.mark.parametrize("path", ["/health", "/health/ready"])
def test_health(http: httpx.Client, path: str) -> None:
    assert http.get(path).status_code == 200


def test_models(openai_client: openai.OpenAI) -> None:
    [model] = openai_client.models.list().data
    assert model.id == MODEL
    assert openai_client.models.retrieve(MODEL).id == MODEL
