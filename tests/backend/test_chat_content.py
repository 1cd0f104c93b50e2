"""Chat content as the model's template reads it: one string, or text parts for templates that
loop over them (vLLM's "string" and "openai" content formats)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from backend.chat_content import ContentError, template_content
from backend.chat_template import reads_content_parts
from backend.params import InvalidInputError
from backend.preprocessing import Preprocessor

PARTS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}[{{ part['text'] }}]"
    "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Reads content only as a list of parts, as multimodal models' templates do."""


@pytest.mark.parametrize(
    ("template", "parts"),
    [
        (PARTS_TEMPLATE, True),
        (
            "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
            True,
        ),
        (
            "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content | selectattr('type', 'eq', 'text') %}{{ p.text }}{% endfor %}"
            "{% endif %}{% endfor %}",
            True,
        ),
        (
            "{% set loop_messages = messages[1:] %}{% for message in loop_messages %}"
            "{% for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}",
            True,
        ),
        ("{% set first = messages[0] %}{% for p in first.content %}{{ p }}{% endfor %}", True),
        # Only a message's content counts, as in vLLM: not a document's, nor messages[0]'s.
        ("{% for d in documents %}{% for p in d.content %}{{ p }}{% endfor %}{% endfor %}", False),
        ("{% for p in messages[0]['content'] %}{{ p }}{% endfor %}", False),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
        ("{% for m in messages %}{% for x in m.tool_calls %}{% endfor %}{% endfor %}", False),
        ("{% for m in messages %", False),  # applying it says what is wrong
        (None, False),
    ],
)
def test_a_template_reads_parts_when_it_loops_over_the_content(
    template: str | None, parts: bool
) -> None:
    assert reads_content_parts(template) is parts


def test_content_takes_vllm_s_text_parts() -> None:
    content = [
        {"type": "text", "text": "a"},
        {"type": "input_text", "text": "b"},
        {"type": "output_text", "text": "c"},
        {"type": "refusal", "refusal": "d"},
        {"type": "thinking", "thinking": "e"},
        {"type": "text", "text": None},  # skipped, as vLLM does
        {"type": "refusal", "refusal": None},
    ]
    assert template_content(content, as_parts=False) == "a\nb\nc\nd\ne"
    assert template_content(content, as_parts=True) == [
        {"type": "text", "text": text} for text in "abcde"
    ]
    assert template_content("x", as_parts=True) == [{"type": "text", "text": "x"}]
    assert template_content(None, as_parts=False) == ""
    assert template_content(None, as_parts=True) == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([{"type": "image_url", "image_url": {"url": "x"}}], "got type 'image_url'"),
        (["text"], "got 'text'"),
        ([{"type": "thinking", "thinking": None}], "type 'thinking' needs its 'thinking'"),
        (5, "must be a string or a list of text parts"),
    ],
)
def test_other_content_is_refused(content: Any, message: str) -> None:
    with pytest.raises(ContentError, match=message):
        template_content(content, as_parts=False)


def _with_template(model_dir: Path, out: Path, template: str) -> Path:
    """The test model's tokenizer and config, with `template` as its chat template."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    shutil.copy(model_dir / "config.json", out / "config.json")
    return out


@pytest.fixture(scope="module")
def parts_model(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_template(model_dir, tmp_path_factory.mktemp("parts"), PARTS_TEMPLATE)


def _ids(preprocessor: Preprocessor, messages: list[dict[str, Any]]) -> list[int]:
    raw = np.array([json.dumps(messages).encode()], dtype=object)
    return preprocessor.to_ids(None, raw).tolist()


@pytest.mark.parametrize(
    "content",
    [
        "Hello world",
        [{"type": "input_text", "text": "Hello world"}, {"type": "text", "text": None}],
    ],
)
def test_a_template_that_loops_over_parts_gets_the_text_as_parts(
    parts_model: Path, content: Any
) -> None:
    """A string would be looped over character by character, and the text lost."""
    preprocessor = Preprocessor(str(parts_model))
    ids = _ids(preprocessor, [{"role": "user", "content": content}])
    tokenizer = preprocessor.tokenizer
    assert (
        tokenizer.decode(ids)
        == "<|im_start|>user\n[Hello world]<|im_end|>\n<|im_start|>assistant\n"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello world"}]}]
    rendered = tokenizer.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_a_string_template_gets_parts_joined_with_newlines(model_dir: Path) -> None:
    preprocessor = Preprocessor(str(model_dir))
    parts = [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}]
    joined = _ids(preprocessor, [{"role": "user", "content": "a\nb"}])
    assert _ids(preprocessor, [{"role": "user", "content": parts}]) == joined


def test_content_that_is_not_text_is_invalid_input(model_dir: Path) -> None:
    preprocessor = Preprocessor(str(model_dir))
    with pytest.raises(InvalidInputError, match="MESSAGES: only text content parts"):
        _ids(preprocessor, [{"role": "user", "content": [{"type": "image_url"}]}])


THINKING_TEMPLATE = (
    "{% if budget is defined %}{{ budget + 1 }}{% endif %}"
    "{% if turns is defined %}{% for _ in range(turns) %}{% endfor %}{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
"""Qwen3's switch, in short: `enable_thinking` false opens the reply with an empty thought."""


@pytest.fixture(scope="module")
def thinking_model(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_template(model_dir, tmp_path_factory.mktemp("thinking"), THINKING_TEMPLATE)


def _rendered(preprocessor: Preprocessor, kwargs: object) -> str:
    messages = np.array([json.dumps([{"role": "user", "content": "Hi"}]).encode()], dtype=object)
    raw = None if kwargs is None else np.array([json.dumps(kwargs).encode()], dtype=object)
    ids = preprocessor.to_ids(None, messages, chat_template_kwargs=raw)
    return preprocessor.tokenizer.decode(ids.tolist())


def test_chat_template_kwargs_reach_the_template(thinking_model: Path) -> None:
    """vLLM's `chat_template_kwargs`: the template's own variables; keys it does not read are
    dropped, as vLLM drops them."""
    preprocessor = Preprocessor(str(thinking_model))
    plain = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert _rendered(preprocessor, None) == plain
    assert _rendered(preprocessor, {"enable_thinking": True, "unread": 1}) == plain
    # The request's own inputs win over the same keys here, as in vLLM.
    assert _rendered(preprocessor, {"add_generation_prompt": False, "messages": []}) == plain
    assert _rendered(preprocessor, {"enable_thinking": False}) == plain + "<think>\n\n</think>\n\n"
    tokenizer = preprocessor.tokenizer
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=False,
    )
    assert _rendered(preprocessor, {"enable_thinking": False}) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ([1], "CHAT_TEMPLATE_KWARGS: must be a JSON object"),
        ({"chat_template": "{{ 1 }}"}, "`chat_template` cannot be set from a request"),
        ({"tokenize": True}, "`tokenize` cannot be set from a request"),
        ({"budget": "x"}, "MESSAGES: the chat template refused them"),  # "x" + 1: a TypeError
        ({"turns": 10**6}, "MESSAGES: the chat template refused them"),  # the sandbox's range
        # transformers walks every value it passes the template: too deep for the stack
        ({"enable_thinking": json.loads("[" * 900 + "]" * 900)}, "MESSAGES: the chat template"),
    ],
)
def test_bad_chat_template_kwargs_are_invalid_input(
    thinking_model: Path, kwargs: object, message: str
) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        _rendered(Preprocessor(str(thinking_model)), kwargs)


def test_chat_template_kwargs_apply_to_messages_only(model_dir: Path) -> None:
    text = np.array([b"Hi"], dtype=object)
    kwargs = np.array([b"{}"], dtype=object)
    with pytest.raises(InvalidInputError, match="CHAT_TEMPLATE_KWARGS: applies to MESSAGES only"):
        Preprocessor(str(model_dir)).to_ids(text, None, chat_template_kwargs=kwargs)
