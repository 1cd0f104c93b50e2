"""Text or chat messages -> prompt token ids, with the model's own tokenizer and chat template."""

from __future__ import annotations

import json

import numpy as np
from transformers import AutoTokenizer

from backend.params import InvalidRequestError
from backend.triton_io import MESSAGES, TEXT_INPUT


def _one_string(name: str, value: np.ndarray) -> str:
    value = np.asarray(value, dtype=object).reshape(-1)
    if value.size != 1:
        raise InvalidRequestError(name, f"expected one element, got {value.size}")
    item = value[0]
    try:
        return item.decode("utf-8") if isinstance(item, bytes) else str(item)
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(name, "is not valid UTF-8") from exc


def _messages(raw: str) -> list[dict]:
    try:
        messages = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(MESSAGES, f"is not valid JSON: {exc.msg}") from exc
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(MESSAGES, "must be a non-empty JSON list of messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(MESSAGES, "each message needs a string `role`")
        if not isinstance(message.get("content", ""), str):
            raise InvalidRequestError(MESSAGES, "only string `content` is supported")
    return messages


class Preprocessor:
    def __init__(self, model_path: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    def to_ids(
        self,
        text: np.ndarray | None,
        messages: np.ndarray | None,
        add_special_tokens: bool | None = None,
    ) -> np.ndarray:
        """INT32 prompt ids. Chat renders the template with the generation prompt; the template
        writes its own special tokens, so none are added by default."""
        if (text is None) == (messages is None):
            raise InvalidRequestError(TEXT_INPUT, f"give exactly one of {TEXT_INPUT}, {MESSAGES}")
        if text is not None:
            prompt = _one_string(TEXT_INPUT, text)
            add = True if add_special_tokens is None else add_special_tokens
        else:
            prompt = self.tokenizer.apply_chat_template(
                _messages(_one_string(MESSAGES, messages)),
                add_generation_prompt=True,
                tokenize=False,
            )
            add = bool(add_special_tokens)
        ids = self.tokenizer(prompt, add_special_tokens=add)["input_ids"]
        return np.asarray(ids, dtype=np.int32)
