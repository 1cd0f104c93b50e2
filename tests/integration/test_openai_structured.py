"""Structured outputs through the adapter, against the real tritonserver: `response_format`
(OpenAI) and `structured_outputs` (vLLM) on both endpoints, streamed = non-streamed, with
logprobs and `n`, the openai SDK's `parse` with a pydantic model, and a 400 naming the field
for a spec the model cannot compile."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.integration.openai_support import MODEL, sse_events
from tests.integration.test_structured_outputs import LABELS, SCHEMA

CHAT = [{"role": "user", "content": "Is this spam?"}]


class Verdict(pydantic.BaseModel):
    label: Literal["spam", "ham"]
    confidence: int = pydantic.Field(ge=0, le=9)


def _completion(http: httpx.Client, **fields: object) -> dict:
    body = {"model": MODEL, "prompt": "Triton serves the model", "max_tokens": 48, **fields}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _streamed_text(http: httpx.Client, path: str, body: dict) -> str:
    with http.stream("POST", path, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        events = sse_events(list(reply.iter_lines()))
    assert events[-1] == "[DONE]"
    pieces = []
    for event in events[:-1]:
        for choice in event["choices"]:
            pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


def test_choice_on_completions_with_n_and_logprobs(http: httpx.Client) -> None:
    body = _completion(
        http,
        structured_outputs={"choice": list(LABELS)},
        n=3,
        temperature=1.0,
        seed=5,
        logprobs=2,
    )
    assert len(body["choices"]) == 3
    for choice in body["choices"]:
        assert choice["text"] in LABELS and choice["finish_reason"] == "stop"
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"]).startswith(choice["text"])  # then EOS, if shown
        assert all(value <= 0 for value in logprobs["token_logprobs"])


def test_regex_streamed_equals_non_streamed(http: httpx.Client) -> None:
    fields = {"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{4}"}, "temperature": 0}
    full = _completion(http, **fields)["choices"][0]["text"]
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", full), full
    body = {"model": MODEL, "prompt": "Triton serves the model", "max_tokens": 48, **fields}
    assert _streamed_text(http, "/v1/completions", body) == full


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_on_chat_validates(http: httpx.Client, temperature: float) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True},
    }
    for seed in range(3 if temperature else 1):
        reply = http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": CHAT,
                "max_tokens": 48,
                "temperature": temperature,
                "seed": seed,
                "response_format": response_format,
            },
        )
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_the_sdk_parses_into_a_pydantic_model(openai_client: openai.OpenAI) -> None:
    completion = openai_client.chat.completions.parse(
        model=MODEL, messages=CHAT, response_format=Verdict, max_tokens=48, temperature=0
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Verdict), completion.choices[0].message.content


def test_json_object_gives_an_object(http: httpx.Client) -> None:
    text = _completion(http, response_format={"type": "json_object"}, temperature=0)["choices"][0][
        "text"
    ]
    assert isinstance(json.loads(text), dict), text


def test_a_spec_the_model_cannot_compile_is_a_400_naming_the_field(http: httpx.Client) -> None:
    reply = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "(unclosed"}},
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "structured_outputs" and "does not compile" in error["message"]
    # The server goes on.
    after = _completion(http, structured_outputs={"choice": list(LABELS)})
    assert after["choices"][0]["text"] in LABELS
