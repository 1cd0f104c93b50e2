"""Request and response models of POST /tokenize and /detokenize (vLLM's shapes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, Field, field_validator, model_validator

from adapter.chat.protocol import ChatMessage
from adapter.errors import InvalidRequestError
from adapter.protocol import (
    ChatTemplateKwargs,
    OpenAIRequest,
    check_chat_template_flags,
    check_token_ids,
)
from adapter.tensors import TritonRequest


class TokenizeRequest(OpenAIRequest):
    """vLLM's two tokenize bodies in one: `prompt` (TokenizeCompletionRequest) or chat
    `messages` (TokenizeChatRequest), tokenized by `preprocessing` as generation would."""

    # vllm/entrypoints/serve/tokenize/protocol.py
    model: str | None = Field(default=None, description="Served model id; null: the only one.")
    prompt: str | None = Field(default=None, description="Text to tokenize; or `messages`.")
    messages: list[ChatMessage] | None = Field(
        default=None,
        min_length=1,
        description="Chat messages, rendered with the chat template and the generation prompt.",
    )
    add_special_tokens: bool | None = Field(
        default=None,
        description="Add BOS etc.; null: true for `prompt`, false for `messages` (the template "
        "adds its own).",
    )
    return_token_strs: bool | None = Field(
        default=False,
        description="Also return `token_strs`: each token's bytes decoded as UTF-8 (U+FFFD for "
        "part of a character; special tokens as their text), not the tokenizer's own pieces.",
    )
    add_generation_prompt: bool | None = Field(
        default=True,
        description="`messages` only: end the rendered chat with the assistant's header.",
    )
    continue_final_message: bool | None = Field(
        default=False,
        description="`messages` only: leave the final message open for the model to continue; "
        "needs `add_generation_prompt: false`.",
    )

    chat_template_kwargs: ChatTemplateKwargs = None

    unsupported: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        "chat_template": (),
        "media_io_kwargs": (),
        "mm_processor_kwargs": (),
        "tools": ([],),
    }

    @model_validator(mode="after")
    def _check_request(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError(
                "Send exactly one of `prompt` and `messages`.", parameter="prompt"
            )
        if self.messages is not None:  # the flags are the chat template's
            check_chat_template_flags(self.add_generation_prompt, self.continue_final_message)
        self.reject_unsupported()
        return self

    def to_generation_params(self) -> TritonRequest:
        """The `preprocessing` inputs that generation would send for this prompt."""
        if self.messages is None:
            return TritonRequest(text=self.prompt, add_special_tokens=self.add_special_tokens)
        return TritonRequest(
            messages=tuple(message.to_template() for message in self.messages),
            add_special_tokens=self.add_special_tokens,
            add_generation_prompt=self.add_generation_prompt,
            chat_template_kwargs=self.chat_template_kwargs or None,
            continue_final_message=self.continue_final_message,
        )


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None = Field(
        description="The `llm` model's context; null when its config leaves it to the model."
    )
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = Field(default=None, description="Served model id; null: the only one.")
    tokens: list[int] = Field(description="Token ids; special tokens come back as their text.")

    @field_validator("tokens", mode="before")
    @classmethod
    def _check_tokens(cls, value: Any) -> Any:
        return check_token_ids(value, parameter="tokens")


class DetokenizeResponse(BaseModel):
    prompt: str
    """The ids' bytes joined and decoded as UTF-8 (errors="replace")."""
