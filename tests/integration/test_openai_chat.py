"""/v1/chat/completions through the real adapter and tritonserver, with the openai SDK and httpx."""

from __future__ import annotations

import httpx
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from backend import contract
from tests.integration.openai_support import (
    MODEL,
    assert_near_reference,
    chat_prompt_ids,
    distinct,
    sse_events,
    token_id,
    triton_direct,
)

MESSAGES = [
    {"role": "system", "content": "Repeat the passage."},
    {"role": "user", "content": "Triton serves the model"},
]


def test_logprobs_equal_triton_and_the_reference(
    openai_client: openai.OpenAI, triton_server, model_dir
) -> None:
    response = openai_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_tokens_as_token_ids": True},
    )
    direct = triton_direct(triton_server.grpc_url, messages=MESSAGES, max_tokens=10, logprobs=3)
    choice = response.choices[0]
    content = choice.logprobs.content
    ids = [token_id(entry.token) for entry in content]
    assert ids == direct.token_ids
    assert choice.message.role == "assistant"
    assert choice.message.content == direct.text
    assert choice.finish_reason == direct.finish_reason
    assert [e.logprob for e in content] == direct.cat(contract.OUTPUT_LOGPROBS).tolist()
    assert [bytes(e.bytes) for e in content] == direct.cat(contract.OUTPUT_TOKEN_BYTES).tolist()
    top_ids = direct.cat(contract.TOP_LOGPROB_IDS).tolist()
    top_values = direct.cat(contract.TOP_LOGPROBS).tolist()
    top_bytes = direct.cat(contract.TOP_LOGPROB_TOKEN_BYTES).tolist()
    for i, entry in enumerate(content):
        assert [token_id(t.token) for t in entry.top_logprobs] == top_ids[i]  # rank order
        assert [t.logprob for t in entry.top_logprobs] == top_values[i]
        assert [bytes(t.bytes) for t in entry.top_logprobs] == top_bytes[i]
    prompt_ids = chat_prompt_ids(model_dir, MESSAGES)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(ids)
    positions = [
        {token_id(t.token): t.logprob for t in [entry, *entry.top_logprobs]} for entry in content
    ]
    assert_near_reference(model_dir, prompt_ids, ids, positions)


def explicit_positions(content: list, requested: list[int]) -> list[dict[int, float]]:
    """Checks each position's set, {sampled} then the distinct ids, and returns it as a dict."""
    positions = []
    for entry in content:
        sampled = token_id(entry.token)
        keys = [token_id(t.token) for t in entry.top_logprobs]
        assert keys == [sampled] + [t for t in distinct(requested) if t != sampled]
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[0].bytes == entry.bytes
        positions.append({k: t.logprob for k, t in zip(keys, entry.top_logprobs, strict=True)})
    return positions


def test_logprob_token_ids(openai_client: openai.OpenAI, triton_server, model_dir) -> None:
    greedy = triton_direct(triton_server.grpc_url, messages=MESSAGES, max_tokens=8)
    requested = [5, greedy.token_ids[0], 900, 5, 1001]
    response = openai_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,  # ignored when ids are given
        extra_body={"logprob_token_ids": requested, "return_tokens_as_token_ids": True},
    )
    content = response.choices[0].logprobs.content
    ids = [token_id(e.token) for e in content]
    assert ids == greedy.token_ids
    positions = explicit_positions(content, requested)
    assert len(positions[0]) == 4  # the sampled id is requested too: once, at the front
    direct = triton_direct(
        triton_server.grpc_url,
        messages=MESSAGES,
        max_tokens=8,
        logprobs=0,
        logprob_token_ids=distinct(requested),
    )
    columns = direct.cat(contract.LOGPROB_TOKEN_LOGPROBS).tolist()
    id_bytes = direct.responses[0][contract.LOGPROB_TOKEN_BYTES].tolist()
    for i, entry in enumerate(content):
        by_id = {token_id(t.token): t for t in entry.top_logprobs[1:]}
        for column, token in enumerate(distinct(requested)):
            if token in by_id:
                assert by_id[token].logprob == columns[i][column]
                assert bytes(by_id[token].bytes) == id_bytes[column]
    assert_near_reference(model_dir, chat_prompt_ids(model_dir, MESSAGES), ids, positions)


def test_continue_final_message_scores_labels_after_an_assistant_prefix(
    openai_client: openai.OpenAI, http: httpx.Client, model_dir
) -> None:
    """The label-scoring prompt: the assistant's message is left open ("The answer is") and
    the ids' logprobs are those of the tokens that continue it."""
    messages = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    prompt_ids = chat_prompt_ids(model_dir, messages, continue_final_message=True)
    assert prompt_ids[-3:] != chat_prompt_ids(model_dir, messages)[-3:]
    tokenized = http.post("/tokenize", json={"messages": messages, **flags}).json()
    assert tokenized["tokens"] == prompt_ids
    labels = [5, 900, 1001]
    response = openai_client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=3,
        temperature=0,
        logprobs=True,
        extra_body={**flags, "logprob_token_ids": labels, "return_tokens_as_token_ids": True},
    )
    assert response.usage is not None and response.usage.prompt_tokens == len(prompt_ids)
    content = response.choices[0].logprobs.content
    ids = [token_id(e.token) for e in content]
    assert_near_reference(model_dir, prompt_ids, ids, explicit_positions(content, labels))
    both = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "continue_final_message": True},
    )
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"


async def test_stream_joins_to_the_full_response(
    async_openai_client: openai.AsyncOpenAI,
) -> None:
    request = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    full = await async_openai_client.chat.completions.create(**request)
    stream = await async_openai_client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    role, *deltas, usage = chunks
    assert role.choices[0].delta.role == "assistant"
    assert usage.choices == [] and usage.usage == full.usage
    reasons = [c.choices[0].finish_reason for c in deltas]
    assert [r for r in reasons if r is not None] == [reasons[-1]]  # exactly one, the last
    assert reasons[-1] == full.choices[0].finish_reason
    assert (
        "".join(c.choices[0].delta.content or "" for c in deltas) == full.choices[0].message.content
    )
    joined = [e for c in deltas for e in c.choices[0].logprobs.content]
    assert joined == full.choices[0].logprobs.content


def test_stream_with_logprob_token_ids(http: httpx.Client) -> None:
    requested = [5, 6, 5, 700]
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "logprob_token_ids": requested,
        "return_tokens_as_token_ids": True,
    }
    full = ChatCompletion.model_validate(http.post("/v1/chat/completions", json=body).json())
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = sse_events(list(response.iter_lines()))
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]  # strict parse
    content = [e for c in chunks[1:] for e in c.choices[0].logprobs.content]
    explicit_positions(content, requested)
    assert content == full.choices[0].logprobs.content
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1


def test_bytes_rebuild_the_message(openai_client: openai.OpenAI) -> None:
    # ignore_eos: no stop token, whose own text is not returned while its bytes are.
    response = openai_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    raw = b"".join(bytes(e.bytes) for e in choice.logprobs.content)
    # The random model emits stray UTF-8 continuation bytes too: both sides show them as U+FFFD.
    assert raw.decode("utf-8", errors="replace") == choice.message.content


def test_max_completion_tokens_wins(openai_client: openai.OpenAI) -> None:
    response = openai_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=9,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"
