"""Text or chat messages -> prompt token ids, with the model's own tokenizer and chat template;
and token ids -> their bytes (detokenization, token strings), without running the model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from jinja2 import TemplateError
from transformers import AutoConfig

from backend.chat_content import ContentError, template_content
from backend.chat_template import (
    REFUSED_VARIABLES,
    SERVER_SET_VARIABLES,
    reads_content_parts,
    template_variables,
)
from backend.context_length import served_context_length
from backend.contract import (
    ADD_GENERATION_PROMPT,
    ADD_SPECIAL_TOKENS,
    CHAT_TEMPLATE_KWARGS,
    CONTINUE_FINAL_MESSAGE,
    INPUT_IDS,
    MESSAGES,
    TEXT_INPUT,
)
from backend.model_folder import load_tokenizer
from backend.params import InvalidInputError
from backend.token_bytes import token_bytes_table


def _one_string(name: str, value: np.ndarray) -> str:
    value = np.asarray(value, dtype=object).reshape(-1)
    if value.size != 1:
        raise InvalidInputError(name, f"expected one element, got {value.size}")
    item = value[0]
    try:
        return item.decode("utf-8") if isinstance(item, bytes) else str(item)
    except UnicodeDecodeError as exc:
        raise InvalidInputError(name, "is not valid UTF-8") from exc


def _json(name: str, value: np.ndarray) -> Any:
    try:
        return json.loads(_one_string(name, value))
    except json.JSONDecodeError as exc:
        raise InvalidInputError(name, f"is not valid JSON: {exc.msg}") from exc
    except RecursionError:
        raise InvalidInputError(name, "is nested too deeply") from None


def _messages(value: np.ndarray, *, as_parts: bool) -> list[dict]:
    """MESSAGES' JSON, each content shaped for the template (`template_content`)."""
    messages = _json(MESSAGES, value)
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError(MESSAGES, "must be a non-empty JSON list of messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidInputError(MESSAGES, "each message needs a string `role`")
        try:
            message["content"] = template_content(message.get("content"), as_parts=as_parts)
        except ContentError as exc:
            raise InvalidInputError(MESSAGES, str(exc)) from None
    return messages


class Preprocessor:
    def __init__(self, model_path: str, max_model_len: int = 0) -> None:
        """`max_model_len`: the context `llm` serves (0: the model's own)."""
        self.tokenizer = load_tokenizer(model_path)
        config = AutoConfig.from_pretrained(model_path)
        self.vocab_size = int(config.get_text_config().vocab_size)
        self._token_bytes = token_bytes_table(self.tokenizer, self.vocab_size)
        self.max_model_len = served_context_length(config, max_model_len)
        # No token covers more characters than its bytes: where the tokenizer keeps every
        # character (causal LMs' byte-level BPE and SentencePiece; not one whose normalizer
        # drops some), a longer text cannot fit the context, and is refused before it is
        # tokenized, as vLLM does (`max_chars_per_token`).
        self._longest_token = max(map(len, self._token_bytes))
        self.max_prompt_chars = self.max_model_len * self._longest_token
        self._content_as_parts = reads_content_parts(self.tokenizer.chat_template)
        self._template_variables = template_variables(self.tokenizer.chat_template)

    def token_bytes(self, ids: np.ndarray) -> np.ndarray:
        """BYTES [n]: each id's bytes (a special token's are its text)."""
        out = np.empty(len(ids), dtype=object)
        out[:] = [self._token_bytes[i] for i in ids.tolist()]
        return out

    def _template_kwargs(self, raw: np.ndarray | None) -> dict[str, Any]:
        """CHAT_TEMPLATE_KWARGS' JSON object, less the keys the template does not read and those
        the request's own inputs set (vLLM drops both); `apply_chat_template`'s own arguments
        are refused, as vLLM refuses them."""
        if raw is None:
            return {}
        given = _json(CHAT_TEMPLATE_KWARGS, raw)
        if not isinstance(given, dict):
            raise InvalidInputError(CHAT_TEMPLATE_KWARGS, "must be a JSON object")
        refused = sorted(REFUSED_VARIABLES & given.keys())
        if refused:
            raise InvalidInputError(
                CHAT_TEMPLATE_KWARGS, f"`{refused[0]}` cannot be set from a request (as in vLLM)"
            )
        return {
            key: value
            for key, value in given.items()
            if key in self._template_variables and key not in SERVER_SET_VARIABLES
        }

    def run_inputs(self, inputs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """`run` on the `preprocessing` model's input tensors by name (absent ones omitted), as
        the model and the adapter's local preprocessing both receive them."""

        def flag(name: str) -> bool | None:
            value = inputs.get(name)
            return None if value is None else bool(np.asarray(value).reshape(-1)[0])

        return self.run(
            inputs.get(TEXT_INPUT),
            inputs.get(MESSAGES),
            flag(ADD_SPECIAL_TOKENS),
            inputs.get(INPUT_IDS),
            add_generation_prompt=flag(ADD_GENERATION_PROMPT),
            continue_final_message=flag(CONTINUE_FINAL_MESSAGE),
            chat_template_kwargs=inputs.get(CHAT_TEMPLATE_KWARGS),
        )

    def run(
        self,
        text: np.ndarray | None,
        messages: np.ndarray | None,
        add_special_tokens: bool | None = None,
        input_ids: np.ndarray | None = None,
        *,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | None = None,
        chat_template_kwargs: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(INPUT_IDS, TOKEN_BYTES) of a text, chat or token-id input (exactly one of them)."""
        if input_ids is None:
            ids = self.to_ids(
                text,
                messages,
                add_special_tokens,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
        elif text is not None or messages is not None:
            raise InvalidInputError(INPUT_IDS, f"give {INPUT_IDS} alone, not with a prompt")
        else:
            ids = np.asarray(input_ids).reshape(-1)
            if ids.dtype.kind not in "iu":
                raise InvalidInputError(INPUT_IDS, f"expected integer ids, got {ids.dtype}")
            bad = ids[(ids < 0) | (ids >= self.vocab_size)]
            if bad.size:
                raise InvalidInputError(
                    INPUT_IDS, f"id {int(bad[0])} is outside the vocabulary [0, {self.vocab_size})"
                )
            ids = ids.astype(np.int32)
        return ids, self.token_bytes(ids)

    def to_ids(
        self,
        text: np.ndarray | None,
        messages: np.ndarray | None,
        add_special_tokens: bool | None = None,
        *,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | None = None,
        chat_template_kwargs: np.ndarray | None = None,
    ) -> np.ndarray:
        """INT32 prompt ids. Chat renders the template, by default with the generation prompt
        (vLLM's `add_generation_prompt`), or leaving the final message open for the model to
        continue (`continue_final_message`); the template writes its own special tokens, so
        none are added by default."""
        if (text is None) == (messages is None):
            raise InvalidInputError(
                TEXT_INPUT,
                f"give exactly one of {TEXT_INPUT}, {MESSAGES}, {INPUT_IDS} (the ensemble takes "
                f"{TEXT_INPUT} or {MESSAGES}; token ids go to llm's {INPUT_IDS})",
            )
        if text is not None:
            for name, flag in [
                (ADD_GENERATION_PROMPT, add_generation_prompt),
                (CONTINUE_FINAL_MESSAGE, continue_final_message),
                (CHAT_TEMPLATE_KWARGS, chat_template_kwargs),
            ]:
                if flag is not None:
                    raise InvalidInputError(name, f"applies to {MESSAGES} only")
            prompt = _one_string(TEXT_INPUT, text)
            add = True if add_special_tokens is None else add_special_tokens
        elif messages is not None:
            generation_prompt = True if add_generation_prompt is None else add_generation_prompt
            if continue_final_message and generation_prompt:
                raise InvalidInputError(
                    CONTINUE_FINAL_MESSAGE,
                    f"needs {ADD_GENERATION_PROMPT} false: the final message is continued, "
                    "no new one is started",
                )
            conversation = _messages(messages, as_parts=self._content_as_parts)
            variables = self._template_kwargs(chat_template_kwargs)
            try:
                rendered = self.tokenizer.apply_chat_template(
                    conversation,
                    add_generation_prompt=generation_prompt,
                    continue_final_message=bool(continue_final_message),
                    tokenize=False,
                    **variables,
                )
            except (TemplateError, ValueError, TypeError, ArithmeticError, RecursionError) as exc:
                # e.g. "Conversation roles must alternate ...", a final message the template
                # rewrites, so that it cannot be left open, or a request's template variable the
                # template cannot use: a string added to 1, jinja's range() past its limit
                # (OverflowError), a value nested too deep for transformers' walk of it
                raise InvalidInputError(MESSAGES, f"the chat template refused them: {exc}") from exc
            prompt = str(rendered)  # tokenize=False: the template's text
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                # JSON escapes one (`"\\ud800"`) into MESSAGES or CHAT_TEMPLATE_KWARGS, which the
                # tokenizer would refuse with a TypeError (a text prompt is decoded from UTF-8).
                raise InvalidInputError(
                    MESSAGES,
                    "the chat template's text holds a lone UTF-16 surrogate escape, which is not "
                    "valid Unicode text",
                ) from None
            add = bool(add_special_tokens)
        if len(prompt) > self.max_prompt_chars:
            # A tokenizer takes seconds for megabytes, and this model's one instance would hold
            # every other prompt behind it meanwhile (an audit: a chat request took 6 s).
            raise InvalidInputError(
                TEXT_INPUT if text is not None else MESSAGES,
                f"the prompt has {len(prompt)} characters, more than this model's maximum "
                f"context length of {self.max_model_len} tokens can hold: at most "
                f"{self.max_prompt_chars} ({self._longest_token} a token at most)",
            )
        ids = self.tokenizer(prompt, add_special_tokens=add)["input_ids"]
        return np.asarray(ids, dtype=np.int32)
