"""The preprocessing model.py driven in-process: TEXT_INPUT or MESSAGES -> INPUT_IDS."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from backend.triton_io import ADD_SPECIAL_TOKENS, INPUT_IDS, MESSAGES, TEXT_INPUT
from tests.fakes.pb_utils import FakeRequest
from tests.reference import tokenizer

TEXT = "Triton serves 你好，世界！ and 😀 café."


def string(value: str | bytes) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=object)


def ids_of(response: Any) -> list[int]:
    assert not response.has_error(), response.error()
    [tensor] = response.output_tensors()
    assert tensor.name() == INPUT_IDS
    assert tensor.as_numpy().dtype == np.int32
    assert tensor.as_numpy().ndim == 1
    return tensor.as_numpy().tolist()


def test_text_gives_the_tokenizers_ids(preprocessing_model: Any, model_dir: Path) -> None:
    [response] = preprocessing_model.execute([FakeRequest({TEXT_INPUT: string(TEXT)})])
    expected = tokenizer(model_dir)(TEXT)["input_ids"]
    assert ids_of(response) == expected
    assert tokenizer(model_dir).decode(expected) == TEXT


def test_messages_are_rendered_with_the_chat_template(
    preprocessing_model: Any, model_dir: Path
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    request = FakeRequest({MESSAGES: string(json.dumps(messages))})
    [response] = preprocessing_model.execute([request])
    rendered = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\n{TEXT}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tok = tokenizer(model_dir)
    ids = ids_of(response)
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 3
    assert ids.count(im_end) == 2


def test_add_special_tokens_is_forwarded(preprocessing_model: Any, model_dir: Path) -> None:
    # The test tokenizer adds no BOS, so both settings give the plain ids; the flag must parse.
    for flag in (True, False):
        request = FakeRequest({TEXT_INPUT: string(TEXT), ADD_SPECIAL_TOKENS: np.array([flag])})
        [response] = preprocessing_model.execute([request])
        assert ids_of(response) == tokenizer(model_dir)(TEXT)["input_ids"]


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({}, "TEXT_INPUT: give exactly one of TEXT_INPUT, MESSAGES"),
        (
            {TEXT_INPUT: string("hi"), MESSAGES: string('[{"role": "user", "content": "hi"}]')},
            "TEXT_INPUT: give exactly one of TEXT_INPUT, MESSAGES",
        ),
        ({MESSAGES: string("not json")}, "MESSAGES: is not valid JSON: Expecting value"),
        ({MESSAGES: string("[]")}, "MESSAGES: must be a non-empty JSON list of messages"),
        ({MESSAGES: string('[{"content": "x"}]')}, "MESSAGES: each message needs a string `role`"),
        ({TEXT_INPUT: string(b"\xff")}, "TEXT_INPUT: is not valid UTF-8"),
    ],
)
def test_bad_input_is_invalid_arg_and_the_batch_is_still_answered(
    preprocessing_model: Any,
    pb_utils: ModuleType,
    model_dir: Path,
    inputs: dict[str, np.ndarray],
    message: str,
) -> None:
    requests = [
        FakeRequest({TEXT_INPUT: string("before")}),
        FakeRequest(inputs),
        FakeRequest({TEXT_INPUT: string("after")}),
    ]
    before, bad, after = preprocessing_model.execute(requests)
    assert bad.has_error()
    assert bad.output_tensors() == []
    assert bad.error().code() == pb_utils.TritonError.INVALID_ARG
    assert bad.error().message() == message
    assert ids_of(before) == tokenizer(model_dir)("before")["input_ids"]
    assert ids_of(after) == tokenizer(model_dir)("after")["input_ids"]
