"""Completions `echo` (lm-eval loglikelihood), `prompt_logprob_token_ids`, chat `echo`,
through the real adapter and tritonserver."""

from __future__ import annotations

import math
from operator import itemgetter

import httpx
import numpy as np
import openai
import pytest

from tests.integration.openai_support import (
    ATOL,
    MODEL,
    distinct,
    reference_next_logprobs,
    reference_prompt_logprobs,
    text_prompt_ids,
    token_id,
)
from tests.reference import tokenizer

PROMPT = "Triton serves the model"
CONTINUATIONS = [" and streams every token.", " and sings."]  # the passage's, and not


def loglikelihoods(response: dict, ctxlens: list[int], *, generated: int) -> list[tuple]:
    """lm-eval's `LocalCompletionsAPI.parse_logprobs`: the continuation's summed logprob and
    whether each of its tokens is the most likely one, per choice in `index` order."""
    results = []
    choices = sorted(response["choices"], key=itemgetter("index"))
    for choice, ctxlen in zip(choices, ctxlens, strict=True):
        end = len(choice["logprobs"]["token_logprobs"]) - generated
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:end]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
        greedy = all(lp == max(top.values()) for lp, top in zip(logprobs, tops, strict=True))
        results.append((sum(logprobs), greedy))
    return results


def reference_loglikelihood(model_dir, context: list[int], continuation: list[int]) -> tuple:
    ref = reference_prompt_logprobs(model_dir, context + continuation)
    rows = ref[len(context) - 1 :]
    picked = [rows[i, token] for i, token in enumerate(continuation)]
    return sum(picked), all(rows[i].argmax() == token for i, token in enumerate(continuation))


@pytest.mark.parametrize("max_tokens", [0, 1])  # lm-eval sent 0, sends 1 and drops the last
def test_lm_eval_loglikelihood_equals_the_reference(
    http: httpx.Client, model_dir, max_tokens: int
) -> None:
    context = text_prompt_ids(model_dir, PROMPT)
    continuations = [
        tokenizer(model_dir)(c, add_special_tokens=False)["input_ids"] for c in CONTINUATIONS
    ]
    body = {
        "model": MODEL,
        "prompt": [context + continuation for continuation in continuations],
        "temperature": 0,
        "max_tokens": max_tokens,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    got = loglikelihoods(response.json(), [len(context)] * 2, generated=max_tokens)
    for (logprob, greedy), continuation in zip(got, continuations, strict=True):
        ref_logprob, ref_greedy = reference_loglikelihood(model_dir, context, continuation)
        assert abs(logprob - ref_logprob) < ATOL * len(continuation), (logprob, ref_logprob)
        assert greedy == ref_greedy
    assert [g for _, g in got] == [True, False]  # the memorised continuation is the greedy one


def test_echo_of_a_token_id_prompt_scores_every_position(http: httpx.Client, model_dir) -> None:
    ids = text_prompt_ids(model_dir, PROMPT + CONTINUATIONS[0])
    body = {"model": MODEL, "prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 3}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == PROMPT + CONTINUATIONS[0]  # the ids' bytes decoded
    assert choice["finish_reason"] == "length"
    assert (logprobs["token_logprobs"][0], logprobs["top_logprobs"][0]) == (None, None)
    ref = reference_prompt_logprobs(model_dir, ids)
    for i in range(1, len(ids)):
        assert abs(logprobs["token_logprobs"][i] - ref[i - 1, ids[i]]) < ATOL
        top = logprobs["top_logprobs"][i]
        assert len(top) <= 4  # the prompt token, then the natural top-3
        natural = sorted(top.values(), reverse=True)[:3]
        assert np.allclose(natural, np.sort(ref[i - 1])[::-1][:3], atol=ATOL)
    assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]


@pytest.mark.parametrize("max_tokens", [0, 2])
def test_echo_of_a_single_token_prompt(http: httpx.Client, model_dir, max_tokens: int) -> None:
    """Its one prompt token has no logprob (null, as vLLM's), and is not an error."""
    [first] = text_prompt_ids(model_dir, "T")
    body = {"model": MODEL, "prompt": [first], "echo": True, "max_tokens": max_tokens}
    body |= {"logprobs": 1, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 1 + max_tokens
    assert (logprobs["token_logprobs"][0], logprobs["top_logprobs"][0]) == (None, None)
    assert logprobs["tokens"][0] == "T"
    if max_tokens:
        ref = reference_next_logprobs(model_dir, [first])
        assert abs(logprobs["token_logprobs"][1] - ref.max()) < ATOL  # greedy


def test_echo_with_generation(openai_client: openai.OpenAI) -> None:
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    plain = openai_client.completions.create(**request).choices[0]
    echoed = openai_client.completions.create(**request, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text
    n_prompt = len(echoed.logprobs.tokens) - len(plain.logprobs.tokens)
    assert "".join(echoed.logprobs.tokens[:n_prompt]) == PROMPT
    assert echoed.logprobs.tokens[n_prompt:] == plain.logprobs.tokens
    # The prefill then scores every prompt position: float32 sums may differ in the last bits.
    generated = echoed.logprobs.token_logprobs[n_prompt:]
    assert generated == pytest.approx(plain.logprobs.token_logprobs, abs=ATOL)
    for echoed_top, plain_top in zip(
        echoed.logprobs.top_logprobs[n_prompt:], plain.logprobs.top_logprobs, strict=True
    ):
        assert echoed_top == pytest.approx(plain_top, abs=ATOL)
    offsets = echoed.logprobs.text_offset
    assert offsets[n_prompt:] == [len(PROMPT) + o for o in plain.logprobs.text_offset]
    for token, offset in zip(echoed.logprobs.tokens, offsets, strict=True):
        assert echoed.text[offset : offset + len(token)] == token


async def test_echo_stream_joins_to_the_full_response(
    async_openai_client: openai.AsyncOpenAI,
) -> None:
    request = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
    }
    full = (await async_openai_client.completions.create(**request)).choices[0]
    stream = await async_openai_client.completions.create(**request, stream=True)
    choices = [chunk.choices[0] async for chunk in stream]
    assert choices[0].text.startswith(PROMPT)  # the prompt comes with the first token
    assert "".join(c.text for c in choices) == full.text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in choices for v in getattr(c.logprobs, key)] == getattr(full.logprobs, key)


@pytest.mark.parametrize("prompt_kind", ["text", "ids", "texts"])
def test_echo_without_logprobs_or_generation(
    openai_client: openai.OpenAI, model_dir, prompt_kind: str
) -> None:
    prompt = {
        "text": PROMPT,
        "ids": text_prompt_ids(model_dir, PROMPT),
        "texts": [PROMPT, "Café 😀"],  # a batch: a choice per prompt, in order
    }[prompt_kind]
    response = openai_client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0)
    expected = prompt if prompt_kind == "texts" else [PROMPT]
    assert [c.text for c in response.choices] == expected
    assert [c.index for c in response.choices] == list(range(len(expected)))
    assert all(c.logprobs is None for c in response.choices)
    assert response.usage.completion_tokens == 0


def test_prompt_logprob_token_ids_equal_the_reference(
    openai_client: openai.OpenAI, model_dir
) -> None:
    ids = text_prompt_ids(model_dir, PROMPT)
    requested = [17, ids[3], 400, 1010, 17]  # a duplicate, a prompt token, a padding id
    response = openai_client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        echo=True,
        logprobs=0,
        max_tokens=0,
        extra_body={"prompt_logprob_token_ids": requested, "return_tokens_as_token_ids": True},
    )
    logprobs = response.choices[0].logprobs  # the SDK parses the null first entries
    assert [token_id(t) for t in logprobs.tokens] == ids
    assert logprobs.top_logprobs[0] is None
    ref = reference_prompt_logprobs(model_dir, ids)
    for i in range(1, len(ids)):
        top = {token_id(k): v for k, v in logprobs.top_logprobs[i].items()}
        # The prompt token first, then each distinct requested id but it, in request order.
        assert list(top) == [ids[i]] + [t for t in distinct(requested) if t != ids[i]]
        for token, value in top.items():
            assert math.isfinite(value) and abs(value - ref[i - 1, token]) < ATOL, (i, token)


def test_prompt_logprob_token_ids_as_text(http: httpx.Client, model_dir) -> None:
    ascii_ids = [i for i in range(100, 400) if tokenizer(model_dir).decode([i]).isalpha()][:3]
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "echo": True,
        "logprobs": 0,
        "max_tokens": 0,
        "prompt_logprob_token_ids": ascii_ids,
    }
    top = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["top_logprobs"]
    expected = [tokenizer(model_dir).decode([i]) for i in ascii_ids]
    for position in top[1:]:
        assert [k for k in list(position)[1:] if k in expected] == [
            e for e in expected if e in position
        ]
        assert set(expected) <= set(position)


CHAT_PREFIX = [
    {"role": "user", "content": "Repeat the passage."},
    {"role": "assistant", "content": "Triton serves"},
]


async def test_chat_echo_prepends_the_assistant_prefix(
    async_openai_client: openai.AsyncOpenAI,
) -> None:
    request = {"model": MODEL, "messages": CHAT_PREFIX, "max_tokens": 4, "temperature": 0}
    plain = await async_openai_client.chat.completions.create(**request)
    echoed = await async_openai_client.chat.completions.create(**request, extra_body={"echo": True})
    generated = plain.choices[0].message.content
    assert echoed.choices[0].message.content == "Triton serves" + generated
    stream = await async_openai_client.chat.completions.create(
        **request, stream=True, extra_body={"echo": True}
    )
    deltas = [chunk.choices[0].delta.content async for chunk in stream]
    assert deltas[:2] == ["", "Triton serves"]  # the role chunk, then the echo
    assert "".join(d or "" for d in deltas) == echoed.choices[0].message.content
    no_gen = await async_openai_client.chat.completions.create(
        **{**request, "max_tokens": 0}, extra_body={"echo": True}
    )
    assert no_gen.choices[0].message.content == "Triton serves"
