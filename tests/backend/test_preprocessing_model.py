"""The preprocessing model.py driven in-process: TEXT_INPUT or MESSAGES -> INPUT_IDS."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from jinja2 import TemplateError

from backend.contract import (
    ADD_GENERATION_PROMPT,
    ADD_SPECIAL_TOKENS,
    CONTINUE_FINAL_MESSAGE,
    INPUT_IDS,
    MESSAGES,
    TEXT_INPUT,
    TOKEN_BYTES,
)
from tests.fakes.pb_utils import FakeRequest
from tests.reference import tokenizer

TEXT = "Triton serves 你好，世界！ and 😀 café."


def string(value: str | bytes) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=object)


def outputs_of(response: Any) -> dict[str, np.ndarray]:
    assert not response.has_error(), response.error()
    outputs = {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}
    assert set(outputs) == {INPUT_IDS, TOKEN_BYTES}
    assert outputs[INPUT_IDS].dtype == np.int32 and outputs[INPUT_IDS].ndim == 1
    assert outputs[TOKEN_BYTES].shape == outputs[INPUT_IDS].shape
    return outputs


def ids_of(response: Any) -> list[int]:
    outputs = outputs_of(response)
    # The bytes of the ids are the text again (this tokenizer adds no special tokens to text).
    return outputs[INPUT_IDS].tolist()


def test_text_gives_the_tokenizers_ids(preprocessing_model: Any, model_dir: Path) -> None:
    [response] = preprocessing_model.execute([FakeRequest({TEXT_INPUT: string(TEXT)})])
    expected = tokenizer(model_dir)(TEXT)["input_ids"]
    assert ids_of(response) == expected
    assert tokenizer(model_dir).decode(expected) == TEXT
    assert b"".join(outputs_of(response)[TOKEN_BYTES].tolist()).decode() == TEXT


def test_input_ids_alone_give_their_bytes(preprocessing_model: Any, model_dir: Path) -> None:
    ids = tokenizer(model_dir)(TEXT)["input_ids"]
    eos = tokenizer(model_dir).eos_token_id
    request = FakeRequest({INPUT_IDS: np.array([*ids, eos, 1023], dtype=np.int32)})
    [response] = preprocessing_model.execute([request])
    pieces = outputs_of(response)[TOKEN_BYTES].tolist()
    assert b"".join(pieces[:-2]).decode() == TEXT
    assert pieces[-2:] == [b"<|endoftext|>", b""]  # special text; a padded id has no bytes


def test_bad_input_ids_are_invalid_arg(preprocessing_model: Any) -> None:
    for arrays, message in [
        ({INPUT_IDS: np.array([5, 1024], dtype=np.int32)}, "id 1024 is outside the vocabulary"),
        ({INPUT_IDS: np.array([5], np.int32), TEXT_INPUT: string("x")}, "give INPUT_IDS alone"),
    ]:
        [response] = preprocessing_model.execute([FakeRequest(arrays)])
        assert response.has_error() and message in response.error().message()


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


PREFILLED = [{"role": "user", "content": "Is it?"}, {"role": "assistant", "content": "It is"}]


@pytest.mark.parametrize(
    ("flags", "rendered"),
    [
        (
            {},
            "<|im_start|>user\nIs it?<|im_end|>\n<|im_start|>assistant\nIt is<|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (
            {ADD_GENERATION_PROMPT: False},
            "<|im_start|>user\nIs it?<|im_end|>\n<|im_start|>assistant\nIt is<|im_end|>\n",
        ),
        (
            {ADD_GENERATION_PROMPT: False, CONTINUE_FINAL_MESSAGE: True},
            "<|im_start|>user\nIs it?<|im_end|>\n<|im_start|>assistant\nIt is",
        ),
    ],
)
def test_chat_flags_choose_how_the_rendered_chat_ends(
    preprocessing_model: Any, model_dir: Path, flags: dict[str, bool], rendered: str
) -> None:
    """vLLM's add_generation_prompt and continue_final_message: a new assistant turn, none, or
    the final message left open for the model to continue."""
    arrays = {name: np.array([flag]) for name, flag in flags.items()}
    request = FakeRequest({MESSAGES: string(json.dumps(PREFILLED)), **arrays})
    [response] = preprocessing_model.execute([request])
    assert ids_of(response) == tokenizer(model_dir)(rendered, add_special_tokens=False)["input_ids"]


def test_add_special_tokens_is_forwarded(preprocessing_model: Any, model_dir: Path) -> None:
    # The test tokenizer adds no BOS, so both settings give the plain ids; the flag must parse.
    for flag in (True, False):
        request = FakeRequest({TEXT_INPUT: string(TEXT), ADD_SPECIAL_TOKENS: np.array([flag])})
        [response] = preprocessing_model.execute([request])
        assert ids_of(response) == tokenizer(model_dir)(TEXT)["input_ids"]


LONE_SURROGATE = (
    "the chat template's text holds a lone UTF-16 surrogate escape, which is not valid Unicode text"
)
ONE_INPUT = (
    "TEXT_INPUT: give exactly one of TEXT_INPUT, MESSAGES, INPUT_IDS (the ensemble takes "
    "TEXT_INPUT or MESSAGES; token ids go to llm's INPUT_IDS)"
)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({}, ONE_INPUT),
        (
            {TEXT_INPUT: string("hi"), MESSAGES: string('[{"role": "user", "content": "hi"}]')},
            ONE_INPUT,
        ),
        ({MESSAGES: string("not json")}, "MESSAGES: is not valid JSON: Expecting value"),
        ({MESSAGES: string("[]")}, "MESSAGES: must be a non-empty JSON list of messages"),
        ({MESSAGES: string('[{"content": "x"}]')}, "MESSAGES: each message needs a string `role`"),
        (
            {MESSAGES: string('[{"role": "user", "content": 5}]')},
            "MESSAGES: a message's `content` must be a string or a list of text parts",
        ),
        ({MESSAGES: string("[" * 100_000 + "]" * 100_000)}, "MESSAGES: is nested too deeply"),
        # JSON may escape a lone surrogate; no UTF-8 text holds one, so the tokenizer would fail.
        *(
            ({MESSAGES: string(messages)}, f"MESSAGES: {LONE_SURROGATE}")
            for messages in [
                '[{"role": "user", "content": "a\\ud800b"}]',
                '[{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]',
            ]
        ),
        ({TEXT_INPUT: string(b"\xff")}, "TEXT_INPUT: is not valid UTF-8"),
        (
            {MESSAGES: string(json.dumps(PREFILLED)), CONTINUE_FINAL_MESSAGE: np.array([True])},
            "CONTINUE_FINAL_MESSAGE: needs ADD_GENERATION_PROMPT false: the final message is "
            "continued, no new one is started",
        ),
        (
            {TEXT_INPUT: string("hi"), ADD_GENERATION_PROMPT: np.array([False])},
            "ADD_GENERATION_PROMPT: applies to MESSAGES only",
        ),
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


def test_an_unexpected_error_fails_its_request_only(
    preprocessing_model: Any, pb_utils: ModuleType, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = preprocessing_model.preprocessor.run

    def run_or_fail(text: Any, *args: Any, **kwargs: Any) -> Any:
        if text is not None and text.tolist() == [b"boom"]:
            raise RuntimeError("a bug")
        return run(text, *args, **kwargs)

    monkeypatch.setattr(preprocessing_model.preprocessor, "run", run_or_fail)
    requests = [FakeRequest({TEXT_INPUT: string(text)}) for text in ("before", "boom", "after")]
    before, bad, after = preprocessing_model.execute(requests)
    assert bad.error().code() == pb_utils.TritonError.INTERNAL
    assert bad.error().message() == "internal error: a bug"
    assert ids_of(before) == tokenizer(model_dir)("before")["input_ids"]
    assert ids_of(after) == tokenizer(model_dir)("after")["input_ids"]


@pytest.mark.parametrize("error", [TemplateError, ValueError])
def test_a_chat_template_s_refusal_is_invalid_arg(
    preprocessing_model: Any,
    pb_utils: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    error: type[Exception],
) -> None:
    """Templates raise on what they refuse (Llama 2's: "Conversation roles must alternate");
    transformers raises ValueError on a final message that a template rewrites, which then
    cannot be continued."""

    def refuse(*args: Any, **kwargs: Any) -> str:
        raise error("Conversation roles must alternate user/assistant/user/assistant")

    tokenizer = preprocessing_model.preprocessor.tokenizer
    monkeypatch.setattr(tokenizer, "apply_chat_template", refuse)
    messages = string('[{"role": "assistant", "content": "hi"}]')
    [response] = preprocessing_model.execute([FakeRequest({MESSAGES: messages})])
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert response.error().message() == (
        "MESSAGES: the chat template refused them: Conversation roles must alternate "
        "user/assistant/user/assistant"
    )


@pytest.mark.parametrize("chat", [False, True])
def test_a_text_longer_than_the_context_can_hold_is_refused_untokenized(
    import_model: Callable[[str], ModuleType],
    model_args: Callable[..., dict[str, str]],
    pb_utils: ModuleType,
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    chat: bool,
) -> None:
    """max_model_len x the vocabulary's longest token (in bytes, at least its characters):
    a longer text cannot fit, and is not tokenized, as vLLM refuses it (a tokenizer takes
    seconds for megabytes, while this model's one instance holds every other prompt)."""
    model = import_model("preprocessing").TritonPythonModel()
    model.initialize(model_args("preprocessing", decoupled=None, max_model_len="8"))
    vocabulary = tokenizer(model_dir)
    longest = max(
        len(vocabulary.convert_tokens_to_string([piece]).encode())
        for piece in vocabulary.convert_ids_to_tokens(list(range(len(vocabulary))))
    )
    preprocessor = model.preprocessor
    assert (preprocessor.max_model_len, preprocessor.max_prompt_chars) == (8, 8 * longest)
    rendered = len(
        preprocessor.tokenizer.apply_chat_template(
            [{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True
        )
    )
    room = preprocessor.max_prompt_chars - (rendered if chat else 0)

    def request(length: int) -> FakeRequest:
        if chat:
            content = json.dumps([{"role": "user", "content": "a" * length}])
            return FakeRequest({MESSAGES: string(content)})
        return FakeRequest({TEXT_INPUT: string("a" * length)})

    fits, refused = model.execute([request(room), request(room + 1)])
    assert len(ids_of(fits)) > 8  # it fits the bound, not the context: llm refuses it later
    assert refused.error().code() == pb_utils.TritonError.INVALID_ARG
    characters = preprocessor.max_prompt_chars + 1
    assert refused.error().message() == (
        f"{MESSAGES if chat else TEXT_INPUT}: the prompt has {characters} characters, more than "
        f"this model's maximum context length of 8 tokens can hold: at most {8 * longest} "
        f"({longest} a token at most)"
    )
    calls: list[str] = []

    class Recording:  # the tokenizer, its calls recorded
        def __getattr__(self, name: str) -> Any:
            return getattr(vocabulary, name)

        def __call__(self, text: str, **kwargs: Any) -> Any:
            calls.append(text)
            return vocabulary(text, **kwargs)

    monkeypatch.setattr(preprocessor, "tokenizer", Recording())
    fits, refused = model.execute([request(room), request(room + 1)])
    assert refused.error().code() == pb_utils.TritonError.INVALID_ARG
    assert len(calls) == 1 and len(calls[0]) == preprocessor.max_prompt_chars
