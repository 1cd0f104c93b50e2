"""Prompts tokenized in the adapter (`adapter.local_preprocessing`) on the test model's folder,
against a fake engine: the ids reach `llm` as `preprocessing` would make them, without a call
to it; refused input gets preprocessing's 400; without the folder, `preprocessing` serves."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from adapter.app import create_app
from adapter.settings import AdapterSettings
from tests.adapter.fakes import FakeEngine, model_script
from tests.integration.openai_support import chat_prompt_ids, text_prompt_ids

TEXT = "Café 😀 naïve"
MESSAGES = [{"role": "user", "content": "¿Qué tal? 你好"}]


@pytest.fixture
def engine(model_dir: Path) -> FakeEngine:
    fake = FakeEngine(respond=model_script)
    fake.info = replace(fake.info, model_path=str(model_dir), max_model_len=256)
    return fake


def app_client(engine: FakeEngine, **settings: object) -> TestClient:
    return TestClient(create_app(AdapterSettings(served_model_name="tiny", **settings), engine))


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with app_client(engine) as test_client:
        yield test_client


def test_chat_and_text_prompts_reach_llm_as_ids_without_preprocessing(
    engine: FakeEngine, client: TestClient, model_dir: Path
) -> None:
    chat = {"messages": MESSAGES, "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1}).status_code == 200
    [(chat_params, _), (text_params, _)] = engine.requests
    assert chat_params.prompt_ids == tuple(chat_prompt_ids(model_dir, MESSAGES))
    assert text_params.prompt_ids == tuple(text_prompt_ids(model_dir, TEXT))
    assert engine.tokenized == []


def test_tokenize_and_detokenize_in_the_adapter(
    engine: FakeEngine, client: TestClient, model_dir: Path
) -> None:
    body = {"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True}
    tokenized = client.post("/tokenize", json=body).json()
    assert tokenized["tokens"] == chat_prompt_ids(model_dir, MESSAGES, continue_final_message=True)
    ids = text_prompt_ids(model_dir, TEXT)
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": TEXT}
    assert (engine.tokenized, engine.detokenized) == ([], [])


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
            "chat_template_kwargs: `tokenize` cannot be set from a request (as in vLLM)",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "ab " * 50_000}]},
            "messages: the prompt has 1500",  # and the template's characters
        ),
        ("/v1/completions", {"prompt": "ab " * 50_000}, "prompt: the prompt has 150000"),
    ],
)
def test_refused_prompts_get_preprocessings_400(
    engine: FakeEngine, client: TestClient, path: str, body: dict, message: str
) -> None:
    response = client.post(path, json={**body, "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(message), error
    assert error["param"] == message.split(":")[0]
    assert engine.requests == [] and engine.tokenized == []


def test_an_id_outside_the_vocabulary_names_tokens(engine: FakeEngine, client: TestClient) -> None:
    response = client.post("/detokenize", json={"tokens": [1, 10**6]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "tokens: id 1000000 is outside the vocabulary [0, 1024)"
    )


def test_without_the_models_folder_preprocessing_tokenizes(
    engine: FakeEngine, tmp_path: Path
) -> None:
    engine.info = replace(engine.info, model_path=str(tmp_path / "elsewhere"))
    with app_client(engine) as client:
        assert client.post("/tokenize", json={"prompt": TEXT}).json()["tokens"] == list(
            TEXT.encode()
        )
    assert [params.text for params in engine.tokenized] == [TEXT]


def test_a_relative_model_path_is_left_to_preprocessing(
    engine: FakeEngine, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton reads a relative `model_path` from its model repository, which the adapter does
    not know: a folder of that name here (the model's own, even) is not taken for it."""
    monkeypatch.chdir(model_dir.parent)
    engine.info = replace(engine.info, model_path=model_dir.name)
    with app_client(engine) as client:
        assert client.post("/tokenize", json={"prompt": TEXT}).json()["tokens"] == list(
            TEXT.encode()
        )
    assert [params.text for params in engine.tokenized] == [TEXT]


def test_switched_off_preprocessing_tokenizes(engine: FakeEngine) -> None:
    with app_client(engine, local_preprocessing=False) as client:
        chat = {"messages": MESSAGES, "max_tokens": 1}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
    [(params, _)] = engine.requests
    assert params.prompt_ids is None and params.messages == tuple(MESSAGES)


def test_ready_once_the_tokenizer_has_loaded(
    engine: FakeEngine, client: TestClient, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def loaded() -> list[str]:
        return [r.message for r in caplog.records if r.name == "adapter.local_preprocessing"]

    engine.ready = False
    with caplog.at_level(logging.INFO, logger="adapter.local_preprocessing"):
        assert client.get("/health/ready").status_code == 503
        assert loaded() == []
        engine.ready = True
        assert client.get("/health/ready").status_code == 200
        assert loaded() == [f"prompts are tokenized in the adapter, with {model_dir}"]
