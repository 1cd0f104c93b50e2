"""/tokenize and /detokenize against a fake engine whose id i is the byte i."""

from __future__ import annotations

from fastapi.testclient import TestClient

from backend import contract
from tests.adapter.fakes import FakeEngine

TEXT = "héllo"


def test_tokenize_a_prompt(engine: FakeEngine, client: TestClient) -> None:
    response = client.post("/tokenize", json={"model": "tiny", "prompt": TEXT})
    assert response.status_code == 200, response.text
    ids = list(TEXT.encode())
    assert response.json() == {"count": 6, "max_model_len": 64, "tokens": ids, "token_strs": None}
    [params] = engine.tokenized
    assert (params.text, params.messages, params.add_special_tokens) == (TEXT, None, None)
    # The chat flags are for messages: preprocessing refuses them with a text.
    assert (params.add_generation_prompt, params.continue_final_message) == (None, None)
    body = {"prompt": TEXT, "continue_final_message": True}  # a chat flag: no bearing on text
    assert client.post("/tokenize", json=body).status_code == 200


def test_tokenize_messages_to_continue(engine: FakeEngine, client: TestClient) -> None:
    messages = [{"role": "assistant", "content": "It is"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    assert client.post("/tokenize", json={"messages": messages, **flags}).status_code == 200
    [params] = engine.tokenized
    assert (params.add_generation_prompt, params.continue_final_message) == (False, True)


def test_tokenize_messages_with_token_strs(engine: FakeEngine, client: TestClient) -> None:
    messages = [{"role": "user", "content": "é"}]
    body = {"messages": messages, "add_special_tokens": True, "return_token_strs": True}
    result = client.post("/tokenize", json=body).json()
    [params] = engine.tokenized
    assert (params.messages, params.add_special_tokens) == (tuple(messages), True)
    assert (params.add_generation_prompt, params.continue_final_message) == (True, False)
    assert len(result["token_strs"]) == result["count"] == len(result["tokens"])
    # A token holding part of a character reads as U+FFFD (the fake's "é" is two tokens).
    assert result["token_strs"].count("\ufffd") == 2


def test_detokenize_joins_the_bytes(engine: FakeEngine, client: TestClient) -> None:
    ids = list(TEXT.encode())
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": TEXT}
    assert engine.detokenized == [tuple(ids)]  # preprocessing, not a generation request
    assert engine.requests == []


def test_detokenize_nothing(engine: FakeEngine, client: TestClient) -> None:
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    assert engine.detokenized == []


def test_detokenize_bad_ids_name_tokens(engine: FakeEngine, client: TestClient) -> None:
    from adapter.errors import TritonInputError

    engine.bytes_error = TritonInputError(
        contract.INPUT_IDS, "id 5000 is outside the vocabulary [0, 64)"
    )
    response = client.post("/detokenize", json={"tokens": [1, 5000]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tokens"
    assert "id 5000 is outside the vocabulary" in response.json()["error"]["message"]


def test_tokenize_rules(client: TestClient) -> None:
    cases = [
        ({}, "prompt", "exactly one of `prompt` and `messages`"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "exactly one"),
        ({"messages": [], "prompt": None}, "messages", "at least 1 item"),
        ({"prompt": "a", "chat_template": "{{ x }}"}, "chat_template", "not supported"),
        (
            {"messages": [{"role": "user", "content": "b"}], "continue_final_message": True},
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to true.",
        ),
    ]
    for body, param, message in cases:
        response = client.post("/tokenize", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param, body
        assert message in response.json()["error"]["message"], body
    response = client.post("/detokenize", json={"tokens": [1, "2"]})
    assert response.json()["error"]["param"] == "tokens"
    assert client.post("/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404
