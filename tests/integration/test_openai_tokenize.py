"""/tokenize and /detokenize through the real adapter and tritonserver."""

from __future__ import annotations

import httpx

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
