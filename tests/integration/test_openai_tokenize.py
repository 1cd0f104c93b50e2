"""/tokenize and /detokenize through the real adapter and tritonserver."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from backend.adapter_server import AdapterServer
from backend.default_model import EOS_TOKEN, PASSAGE
from tests.integration.openai_support import MODEL, chat_prompt_ids, text_prompt_ids

TEXT = "Café 😀 日本語のテキスト, naïve 🚀"


def test_tokenize_detokenize_round_trip(http: httpx.Client, model_dir) -> None:
    tokenized = http.post("/tokenize", json={"model": MODEL, "prompt": TEXT}).json()
    ids = text_prompt_ids(model_dir, TEXT)
    assert tokenized == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    assert http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": TEXT}


def test_token_strs_are_each_tokens_text(http: httpx.Client) -> None:
    body = {"prompt": TEXT, "return_token_strs": True}
    tokenized = http.post("/tokenize", json=body).json()
    strs = tokenized["token_strs"]
    assert len(strs) == tokenized["count"]
    whole = [s for s in strs if "\ufffd" not in s]  # a token with part of a character: U+FFFD
    assert "".join(whole) == "".join(c for c in "".join(strs) if c != "\ufffd")
    assert any("\ufffd" in s for s in strs) and "Caf" in "".join(strs)


def test_tokenize_chat_messages_as_generation_does(http: httpx.Client, model_dir) -> None:
    messages = [{"role": "user", "content": "¿Qué tal? 你好"}]
    tokenized = http.post("/tokenize", json={"messages": messages}).json()
    assert tokenized["tokens"] == chat_prompt_ids(model_dir, messages)
    text = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert "¿Qué tal? 你好" in text and "<|im_start|>" in text  # special tokens as their text


def test_detokenize_special_and_long_ids(http: httpx.Client, model_dir) -> None:
    ids = text_prompt_ids(model_dir, PASSAGE) * 2  # longer than the 256-token context
    assert len(ids) > 256
    prompt = http.post("/detokenize", json={"tokens": [*ids, 0]}).json()["prompt"]
    assert prompt == PASSAGE * 2 + EOS_TOKEN


@pytest.fixture(scope="module")
def by_triton(triton_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A second adapter whose prompts `preprocessing` tokenizes (`--local-preprocessing false`)."""
    server = AdapterServer(
        triton_url=triton_server.grpc_url,
        port=0,
        served_model_name="test-model",
        log_path=tmp_path_factory.mktemp("adapter-by-triton") / "adapter.log",
        options={"local_preprocessing": "false"},
    )
    with server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


CONVERSATION = [
    {"role": "system", "content": "Réponds en français."},
    {"role": "user", "content": [{"type": "text", "text": "¿Qué tal? 你好"}]},
    {"role": "assistant", "content": "Très bien 😀"},
]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": TEXT, "return_token_strs": True}),
        ("/tokenize", {"prompt": TEXT, "add_special_tokens": False}),
        ("/tokenize", {"messages": CONVERSATION}),
        (
            "/tokenize",
            {
                "messages": CONVERSATION,
                "add_generation_prompt": False,
                "continue_final_message": True,
                "chat_template_kwargs": {"unused": 1},
            },
        ),
        ("/detokenize", {"tokens": [0, 1, 2, 500, 1023]}),
        ("/detokenize", {"tokens": [1, 1024]}),
        ("/tokenize", {"messages": CONVERSATION, "chat_template_kwargs": {"tokenize": True}}),
        ("/tokenize", {"prompt": "ab " * 50_000}),
        ("/v1/chat/completions", {"messages": CONVERSATION[:2], "max_tokens": 8, "seed": 1}),
        (
            "/v1/completions",
            {"prompt": TEXT, "max_tokens": 8, "logprobs": 2, "echo": True, "seed": 2},
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 4000}]}),
    ],
)
def test_the_adapter_tokenizes_as_preprocessing_does(
    http: httpx.Client, by_triton: httpx.Client, path: str, body: dict
) -> None:
    """The same answer, error or not, whether the adapter or `preprocessing` tokenized."""
    local, remote = http.post(path, json=body), by_triton.post(path, json=body)
    assert local.status_code == remote.status_code
    different = {"id", "created"}  # a completion's own
    assert {k: v for k, v in local.json().items() if k not in different} == {
        k: v for k, v in remote.json().items() if k not in different
    }


def preprocessing_calls(triton_server) -> int:
    """Requests the `preprocessing` model has served (Triton's statistics extension)."""
    stats = httpx.get(f"{triton_server.http_url}/v2/models/preprocessing/stats").json()
    return stats["model_stats"][0]["inference_stats"]["success"]["count"]


def test_only_the_adapter_told_to_leaves_tokenizing_to_preprocessing(
    http: httpx.Client, by_triton: httpx.Client, triton_server
) -> None:
    chat = {"messages": CONVERSATION[:2], "max_tokens": 2}
    before = preprocessing_calls(triton_server)
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert http.post("/tokenize", json={"prompt": TEXT}).status_code == 200
    assert preprocessing_calls(triton_server) == before
    assert by_triton.post("/v1/chat/completions", json=chat).status_code == 200
    assert by_triton.post("/tokenize", json={"prompt": TEXT}).status_code == 200
    assert preprocessing_calls(triton_server) == before + 2
