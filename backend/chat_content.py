"""A chat message's content: a string, or a list of text parts, as the OpenAI API allows.

vLLM reads the part types `text`, `input_text` and `output_text` (the text in `"text"`),
`refusal` and `thinking` (in the key of that name) as text, and skips a `text` or `refusal`
part whose text is null (`vllm/entrypoints/chat_utils.py`); so do we. No torch and no jinja2
here: the adapter checks a request's parts with it, and `preprocessing` shapes them for the
template (`backend/preprocessing.py`).
"""

from __future__ import annotations

from typing import Any

TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""Each text-like part type -> the key that holds its text."""

_SKIPPED_WHEN_NULL = frozenset({"text", "refusal"})


class ContentError(ValueError):
    """A message content that is neither a string nor a list of text parts."""


def content_texts(content: Any) -> str | list[str]:
    """The content as a string, or (a list of parts, or null: none) the texts of its parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ContentError("a message's `content` must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_KEYS:
            raise ContentError(
                'only text content parts (`{"type": "text", "text": ...}`, or '
                f"{', '.join(sorted(set(TEXT_PART_KEYS) - {'text'}))}) are supported, got "
                f"{'type ' + repr(kind) if isinstance(part, dict) else repr(part)}"
            )
        text = part.get(TEXT_PART_KEYS[kind])
        if text is None and kind in _SKIPPED_WHEN_NULL:
            continue
        if not isinstance(text, str):
            raise ContentError(
                f"a content part of type {kind!r} needs its {TEXT_PART_KEYS[kind]!r} as a string"
            )
        texts.append(text)
    return texts


def template_content(content: Any, *, as_parts: bool) -> str | list[dict[str, str]]:
    """The content as a chat template reads it: one string, the parts' texts joined with
    newlines (vLLM's "string" format); or (`as_parts`, for a template that loops over the
    content) a list of `{"type": "text", "text": ...}` parts, a string becoming one part
    (vLLM's "openai" format)."""
    texts = content_texts(content)
    if not as_parts:
        return texts if isinstance(texts, str) else "\n".join(texts)
    parts = [texts] if isinstance(texts, str) else texts
    return [{"type": "text", "text": text} for text in parts]
