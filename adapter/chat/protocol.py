"""Request and response models of POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, JsonValue, PrivateAttr, model_validator
from typing_extensions import TypedDict

from adapter.errors import InvalidRequestError
from adapter.protocol import (
    VLLM_UNSUPPORTED,
    ChatTemplateKwargs,
    GenerationRequest,
    OpenAIBaseModel,
    StopReason,
    UsageInfo,
    check_chat_template_flags,
    check_logprob_token_ids,
    check_min_tokens,
    token_limit_or_default,
)
from adapter.tensors import TritonRequest
from backend.chat_content import ContentError, content_texts

TEMPLATE_ROLES = frozenset({"system", "developer", "user", "assistant"})
ROLE_ENUM: list[JsonValue] = [*sorted(TEMPLATE_ROLES)]  # the schema's `enum` of `role`
"""Roles passed to the chat template; `tool` / `function` need tool support (later issue)."""


class ChatMessage(OpenAIBaseModel):
    """One input message; content is a string or a list of text parts
    (`backend/chat_content.py`)."""

    role: str = Field(
        description="Who wrote it.",
        # In the schema (clients, fuzzers), while `_check_message` gives the error message.
        json_schema_extra={"enum": ROLE_ENUM},
    )
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    reasoning: str | None = Field(
        default=None,
        description="An assistant message's reasoning, which thinking models' templates show.",
    )
    reasoning_content: str | None = Field(default=None, description="Alias of `reasoning`.")
    tool_calls: list[Any] | None = None
    _texts: str | list[str] = PrivateAttr(default_factory=list)

    unsupported: ClassVar[Mapping[str, tuple[Any, ...]]] = {"tool_calls": ([],)}

    @model_validator(mode="after")
    def _check_message(self) -> ChatMessage:
        if self.role not in TEMPLATE_ROLES:
            raise InvalidRequestError(
                f"Messages with role `{self.role}` are not supported; use one of "
                f"{sorted(TEMPLATE_ROLES)}.",
                parameter="messages",
                value=self.role,
            )
        self.reject_unsupported(parent="messages")
        try:
            self._texts = content_texts(self.content)
        except ContentError as exc:
            raise InvalidRequestError(f"Invalid message: {exc}.", parameter="messages") from exc
        return self

    def text(self) -> str:
        """The content as one string, parts joined with newlines (vLLM's echo)."""
        return self._texts if isinstance(self._texts, str) else "\n".join(self._texts)

    def to_template(self) -> dict[str, Any]:
        """The message as `preprocessing` takes it: content a string or a list of text parts,
        which it shapes for the model's chat template. An assistant's reasoning goes under both
        of its names, as vLLM passes it, for templates that read either."""
        texts = self._texts
        content = texts if isinstance(texts, str) else [{"type": "text", "text": t} for t in texts]
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if self.role == "assistant" and reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        return message


class ChatCompletionRequest(GenerationRequest):
    """The body of POST /v1/chat/completions; the shared fields are in `GenerationRequest`."""

    # https://platform.openai.com/docs/api-reference/chat/create
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    audio: dict[str, Any] | None = Field(default=None, description="Not supported.")
    function_call: str | dict[str, Any] | None = Field(default=None, description="Not supported.")
    functions: list[dict[str, Any]] | None = Field(default=None, description="Not supported.")
    logprobs: bool | None = Field(
        default=False, description="Return the logprob of each generated token."
    )
    # At least 1, as vLLM and OpenAI: a reply of no tokens is no reply; 0 only with `echo`,
    # which then returns the continued message's prefix alone (`_check_request`).
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="Tokens to generate at most; wins over `max_tokens`."
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="Deprecated alias of `max_completion_tokens`."
    )
    metadata: dict[str, Any] | None = Field(default=None, description="Accepted, not used.")
    modalities: list[str] | None = Field(default=None, description='Only ["text"].')
    parallel_tool_calls: bool | None = Field(default=None, description="Accepted, no tools.")
    prediction: dict[str, Any] | None = Field(default=None, description="Not supported.")
    prompt_cache_key: str | None = Field(default=None, description="Accepted, not used.")
    reasoning_effort: str | None = Field(default=None, description="Not supported.")
    safety_identifier: str | None = Field(default=None, description="Accepted, not used.")
    service_tier: str | None = Field(default=None, description="Accepted, not used.")
    store: bool | None = Field(default=None, description="Accepted, nothing is stored.")
    tool_choice: str | dict[str, Any] | None = Field(default=None, description='Only "none".')
    tools: list[dict[str, Any]] | None = Field(default=None, description="Not supported yet.")
    top_logprobs: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="Most likely alternatives per position; needs `logprobs`."
    )
    verbosity: str | None = Field(default=None, description="Not supported.")
    web_search_options: dict[str, Any] | None = Field(default=None, description="Not supported.")

    # vLLM extension
    add_generation_prompt: bool | None = Field(
        default=True,
        description="vLLM: end the rendered chat with the assistant's header, so that the model "
        "writes a new message.",
    )
    continue_final_message: bool | None = Field(
        default=False,
        description="vLLM: leave the final message open, so that the model continues it (an "
        'assistant prefix such as "The answer is"); needs `add_generation_prompt: false`.',
    )
    chat_template_kwargs: ChatTemplateKwargs = None
    echo: bool | None = Field(
        default=False,
        description="vLLM: when the last message has the reply's role (the assistant's, or any "
        "without a generation prompt), its content is returned before the generated text "
        "(streamed as the first content delta; no logprobs).",
    )

    unsupported: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        **VLLM_UNSUPPORTED,
        "audio": (),
        "function_call": ("none",),
        "functions": ([],),
        "modalities": (["text"],),
        "prediction": (),
        "reasoning_effort": (),
        "tool_choice": ("none",),
        "tools": ([],),
        "verbosity": (),
        "web_search_options": (),
        "use_beam_search": (False,),
        "best_of": (1,),
        "prompt_logprob_token_ids": (),  # completions only: it needs `echo` of the prompt
        "chat_template": (),
        "documents": (),
        "mm_processor_kwargs": (),
    }

    @model_validator(mode="after")
    def _check_request(self) -> ChatCompletionRequest:
        check_logprob_token_ids(
            self.logprob_token_ids,
            logprobs_requested=bool(self.logprobs),
            requirement="`logprobs: true`",
            use_beam_search=bool(self.use_beam_search),
        )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "`top_logprobs` requires `logprobs: true`.", parameter="top_logprobs"
            )
        if self.token_limit() == 0 and not self.echo:
            raise InvalidRequestError(
                f"`{self.token_limit_parameter()}` must be at least 1 (0 only with `echo`).",
                parameter=self.token_limit_parameter(),
                value=0,
            )
        check_min_tokens(self.min_tokens, self.token_limit())
        check_chat_template_flags(self.add_generation_prompt, self.continue_final_message)
        self.reject_unsupported()
        return self

    def token_limit(self) -> int | None:
        """The request's own limit: `max_completion_tokens`, else `max_tokens`, else None."""
        return next(
            (v for v in (self.max_completion_tokens, self.max_tokens) if v is not None), None
        )

    def token_limit_parameter(self) -> str:
        """The field `token_limit` reads, or would: errors about the limit name it."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def reply_role(self) -> str:
        """The reply's role: the assistant's when the template starts a new message, else the
        last message's, which the reply continues (vLLM's `get_chat_request_role`; null is
        the default, true)."""
        return "assistant" if self.add_generation_prompt is not False else self.messages[-1].role

    def echo_text(self) -> str:
        """What `echo` puts before the generated text: the last message's content when it has
        the reply's role (vLLM)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.reply_role() else ""

    def to_generation_params(self, default_max_tokens: int | None) -> list[TritonRequest]:
        """The model's inputs, one per choice: the user's value, else the server's default,
        else the model's.

        Chat has no default token limit: without one the model generates up to
        `default_max_tokens` (`token_limit_or_default`).
        """
        sampling = self.sampling_params()
        logprobs = None
        if self.logprobs:
            # With explicit ids the natural top-k is not returned, so it is not computed either.
            logprobs = 0 if sampling.logprob_token_ids else (self.top_logprobs or 0)
        limit = self.token_limit()
        params = replace(
            sampling,
            messages=tuple(message.to_template() for message in self.messages),
            add_generation_prompt=self.add_generation_prompt,
            chat_template_kwargs=self.chat_template_kwargs or None,
            continue_final_message=self.continue_final_message,
            max_tokens=token_limit_or_default(limit, default_max_tokens),
            max_tokens_parameter=None if limit is None else self.token_limit_parameter(),
            logprobs=logprobs,
        )
        return self.samples(params)


# The entries are TypedDicts, not models: a response with 1024 `logprob_token_ids` holds 1024
# of them a token, and a dict is built for a tenth of a model's cost (docs/design.md, "Logprob
# entries as dicts"). `ChatCompletionLogProbs` is built with `model_construct` from the
# engine's own values (`ChatLogprobsBuilder`), so they are not validated again; the schema
# still documents and serializes them.
class ChatCompletionLogProb(TypedDict):
    """One token: its text, its logprob, and its real bytes from the model (which may be part
    of a multi-byte character)."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb]


class ChatCompletionLogProbs(BaseModel):
    """Each generated token's logprob entry, with its `top_logprobs`."""

    content: list[ChatCompletionLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str = Field(default="assistant", json_schema_extra={"enum": ROLE_ENUM})
    content: str


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = Field(default=None, json_schema_extra={"enum": ROLE_ENUM})
    content: str | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
