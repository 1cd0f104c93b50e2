"""Sampling fields through the real adapter and tritonserver: `n`, `seed`, stop rules,
`logit_bias`, `allowed_token_ids`, `min_p`, penalties, `min_tokens`. They change sampling, never the
reported (raw) logprobs."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from backend.default_model import PASSAGE
from tests.integration.openai_support import (
    ATOL,
    MODEL,
    chat_prompt_ids,
    reference_logprobs,
    text_prompt_ids,
    token_id,
)

PROMPT = "Triton serves the model"
REPETITIVE = [40, 41] * 20  # greedy decoding keeps repeating it
HOT = {"temperature": 1.5, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def test_n_seeded_samples_are_reproducible_and_differ(
    openai_client: openai.OpenAI, model_dir
) -> None:
    request = {"model": MODEL, "prompt": "x", "n": 3, "seed": 42, **HOT}
    first = openai_client.completions.create(**request)
    again = openai_client.completions.create(**request)
    texts = [choice.text for choice in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in again.choices] == texts  # same seed, same samples
    assert len(set(texts)) == 3  # seed, seed + 1, seed + 2: independent samples
    assert first.usage.completion_tokens == 3 * 12
    assert first.usage.prompt_tokens == len(text_prompt_ids(model_dir, "x"))  # counted once
    single = openai_client.completions.create(**{**request, "n": 1, "seed": 43})
    assert single.choices[0].text == texts[1]  # sample i is seed + i


async def test_n_streams_join_per_index(async_openai_client: openai.AsyncOpenAI) -> None:
    request = {"model": MODEL, "prompt": "x", "n": 3, "seed": 7, **HOT}
    full = await async_openai_client.completions.create(**request)
    stream = await async_openai_client.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage == full.usage
    joined = {i: "" for i in range(3)}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        joined[choice.index] += choice.text
    assert [joined[i] for i in range(3)] == [c.text for c in full.choices]


async def test_chat_n_with_seed(async_openai_client: openai.AsyncOpenAI) -> None:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "n": 2,
        "seed": 3,
        "temperature": 1.5,
        "max_completion_tokens": 10,
        "extra_body": {"ignore_eos": True},
    }
    full = await async_openai_client.chat.completions.create(**request)
    contents = [choice.message.content for choice in full.choices]
    assert contents[0] != contents[1]
    stream = await async_openai_client.chat.completions.create(**request, stream=True)
    joined = ["", ""]
    async for chunk in stream:
        joined[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert joined == contents


def test_stop_rules(openai_client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Repeat the passage."}]
    request = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
    free = openai_client.chat.completions.create(**request).choices[0].message.content
    stop = free[8:11]
    cut = openai_client.chat.completions.create(**request, stop=stop).choices[0]
    assert (cut.message.content, cut.finish_reason) == (free[: free.index(stop)], "stop")
    kept = openai_client.chat.completions.create(
        **request, stop=[stop], extra_body={"include_stop_str_in_output": True}
    ).choices[0]
    assert kept.message.content == free[: free.index(stop) + len(stop)]

    greedy = openai_client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    ).choices[0]
    ids = [token_id(token) for token in greedy.logprobs.tokens]
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    stopped = openai_client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [ids[at]]},
    )
    # The stop id ends the text: generated and counted, its own text not returned.
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == at + 1
    assert greedy.text.startswith(stopped.choices[0].text)
    assert len(stopped.choices[0].text) < len(greedy.text)


def test_logit_bias_forces_a_token_whose_logprob_stays_raw(http: httpx.Client, model_dir) -> None:
    forced = 500
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 0,
        "logit_bias": {str(forced): 100},
        "return_tokens_as_token_ids": True,
    }
    logprobs = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert [token_id(t) for t in logprobs["tokens"]] == [forced] * 4
    ref = reference_logprobs(model_dir, text_prompt_ids(model_dir, PROMPT), [forced] * 4)
    for i, logprob in enumerate(logprobs["token_logprobs"]):
        assert abs(logprob - ref[i, forced]) < ATOL
        assert logprob < -1  # the raw log-softmax, not the biased one (about 0)


def test_allowed_token_ids_restrict_sampling(openai_client: openai.OpenAI, model_dir) -> None:
    allowed = [40, 41, 42]
    response = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=12,
        temperature=1.0,
        seed=5,
        logprobs=True,
        extra_body={
            "allowed_token_ids": allowed,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
        },
    )
    ids = [token_id(entry.token) for entry in response.choices[0].logprobs.content]
    assert len(ids) == 12 and set(ids) <= set(allowed)
    ref = reference_logprobs(
        model_dir, chat_prompt_ids(model_dir, [{"role": "user", "content": "Hi"}]), ids
    )
    for i, entry in enumerate(response.choices[0].logprobs.content):
        assert abs(entry.logprob - ref[i, ids[i]]) < ATOL  # raw, over the whole vocabulary


@pytest.mark.parametrize("min_p", [1.0, 0.3])
def test_min_p_samples_only_ids_probable_enough_after_temperature(
    openai_client: openai.OpenAI, model_dir, min_p: float
) -> None:
    """Each sampled id's probability at temperature 1.5 (float64 reference) is at least min_p
    times the most probable id's; min_p 1 leaves only the argmax."""
    response = openai_client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        seed=9,
        logprobs=0,
        **{
            **HOT,
            "extra_body": {"ignore_eos": True, "min_p": min_p, "return_tokens_as_token_ids": True},
        },
    )
    ids = [token_id(t) for t in response.choices[0].logprobs.tokens]
    ref = reference_logprobs(model_dir, text_prompt_ids(model_dir, PROMPT), ids)
    scaled = ref / HOT["temperature"]
    for position, sampled in enumerate(ids):
        share = math.exp(scaled[position, sampled] - scaled[position].max())
        assert share >= min_p - 1e-4, (position, share)


@pytest.mark.parametrize(
    "penalty",
    [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}],
)
def test_penalties_break_repetition(http: httpx.Client, penalty: dict) -> None:
    body = {
        "model": MODEL,
        "prompt": REPETITIVE,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }

    def distinct_tokens(extra: dict) -> int:
        response = http.post("/v1/completions", json={**body, **extra})
        assert response.status_code == 200, response.text
        return len(set(response.json()["choices"][0]["logprobs"]["tokens"]))

    assert distinct_tokens(penalty) > distinct_tokens({})


def test_min_tokens_holds_off_eos(openai_client: openai.OpenAI, model_dir) -> None:
    ids = text_prompt_ids(model_dir, PASSAGE)  # the whole passage: the model answers EOS
    request = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0}
    assert openai_client.completions.create(**request).usage.completion_tokens == 1
    held = openai_client.completions.create(**request, extra_body={"min_tokens": 4})
    assert held.usage.completion_tokens >= 4
