"""Request and response models of POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from adapter.errors import InvalidRequestError
from adapter.protocol import (
    INT32_MAX,
    VLLM_UNSUPPORTED,
    OpenAIBaseModel,
    StreamOptions,
    UsageInfo,
    check_logprob_token_ids,
    check_stream_options,
    check_token_ids,
    distinct,
    normalize_stop,
)
from adapter.tensors import GenerationParams

TEMPLATE_ROLES = frozenset({"system", "developer", "user", "assistant"})
"""Roles passed to the chat template; `tool` / `function` need tool support (later issue)."""


class ChatMessage(OpenAIBaseModel):
    """One input message; content is a string or a list of text parts."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None

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
        self.reject_unsupported()
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        'Only text content parts (`{"type": "text", "text": ...}`) are '
                        f"supported, got type {part.get('type')!r}.",
                        parameter="messages",
                    )
        return self

    def to_template(self) -> dict[str, str]:
        """The message as chat templates expect it: content as one string.

        Text parts are joined with newlines, as vLLM does.
        """
        if isinstance(self.content, list):
            content = "\n".join(part["text"] for part in self.content)
        else:
            content = self.content or ""
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(OpenAIBaseModel):
    """The body of POST /v1/chat/completions."""

    # https://platform.openai.com/docs/api-reference/chat/create
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = Field(default=None, description="Served model id; null: the only one.")
    audio: dict[str, Any] | None = Field(default=None, description="Not supported.")
    frequency_penalty: float | None = Field(default=0.0, description="Only 0 is supported.")
    function_call: str | dict[str, Any] | None = Field(default=None, description="Not supported.")
    functions: list[dict[str, Any]] | None = Field(default=None, description="Not supported.")
    logit_bias: dict[str, float] | None = Field(default=None, description="Not supported yet.")
    logprobs: bool | None = Field(
        default=False, description="Return the logprob of each generated token."
    )
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="Tokens to generate at most; wins over `max_tokens`."
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="Deprecated alias of `max_completion_tokens`."
    )
    metadata: dict[str, Any] | None = Field(default=None, description="Accepted, not used.")
    modalities: list[str] | None = Field(default=None, description='Only ["text"].')
    n: int | None = Field(default=1, description="Only 1 is supported.")
    parallel_tool_calls: bool | None = None
    prediction: dict[str, Any] | None = Field(default=None, description="Not supported.")
    presence_penalty: float | None = Field(default=0.0, description="Only 0 is supported.")
    prompt_cache_key: str | None = None
    reasoning_effort: str | None = Field(default=None, description="Not supported.")
    response_format: dict[str, Any] | None = Field(
        default=None, description='Only {"type": "text"}.'
    )
    safety_identifier: str | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    service_tier: str | None = None
    stop: str | list[str] | None = Field(default=None, description="Stop strings, not returned.")
    store: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="0 is greedy; null: 1.0."
    )
    tool_choice: str | dict[str, Any] | None = Field(default=None, description='Only "none".')
    tools: list[dict[str, Any]] | None = Field(default=None, description="Not supported yet.")
    top_logprobs: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="Most likely alternatives per position; needs `logprobs`."
    )
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    user: str | None = None
    verbosity: str | None = Field(default=None, description="Not supported.")
    web_search_options: dict[str, Any] | None = Field(default=None, description="Not supported.")

    # vLLM extensions (vllm/entrypoints/openai/protocol.py)
    top_k: Annotated[int, Field(ge=-1)] | None = Field(
        default=None, description="Sample from the k most likely tokens; -1 or 0: off."
    )
    stop_token_ids: list[int] | None = Field(
        default=None, description="Token ids that end the generation (kept in the output)."
    )
    ignore_eos: bool | None = Field(default=None, description="Keep generating after EOS.")
    use_beam_search: bool | None = Field(default=False, description="Not supported.")
    logprob_token_ids: list[int] | None = Field(
        default=None,
        description="Token ids whose logprobs are returned at every position, in "
        "`top_logprobs` after the sampled token; requires `logprobs: true`.",
    )
    return_tokens_as_token_ids: bool | None = Field(
        default=None, description='Tokens as "token_id:N" instead of text.'
    )
    add_special_tokens: bool | None = Field(
        default=None,
        description="Add BOS etc. on top of the chat template's own; null: false.",
    )

    unsupported: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        **VLLM_UNSUPPORTED,
        "audio": (),
        "frequency_penalty": (0,),
        "function_call": ("none",),
        "functions": ([],),
        "logit_bias": ({},),
        "modalities": (["text"],),
        "n": (1,),
        "prediction": (),
        "presence_penalty": (0,),
        "reasoning_effort": (),
        "response_format": ({"type": "text"},),
        "tool_choice": ("none",),
        "tools": ([],),
        "verbosity": (),
        "web_search_options": (),
        "use_beam_search": (False,),
        "echo": (False,),
        "add_generation_prompt": (True,),
        "continue_final_message": (False,),
        "chat_template": (),
        "chat_template_kwargs": ({},),
        "documents": (),
        "mm_processor_kwargs": (),
    }

    @field_validator("logprob_token_ids", "stop_token_ids", mode="before")
    @classmethod
    def _check_token_ids(cls, value: Any, info: ValidationInfo) -> Any:
        return check_token_ids(value, parameter=info.field_name)

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
        self.reject_unsupported()
        check_stream_options(self.stream, self.stream_options)
        return self

    def to_generation_params(self, max_model_len: int | None) -> GenerationParams:
        """The model's inputs: the user's value, else the server's default, else the model's.

        Chat has no token limit of its own: without one the model generates until the context
        (`max_model_len`, or the model's own when unknown: INT32_MAX then reaches it) is full.
        """
        explicit = distinct(self.logprob_token_ids)
        max_tokens = next(
            (v for v in (self.max_completion_tokens, self.max_tokens) if v is not None),
            max_model_len or INT32_MAX,
        )
        logprobs = None
        if self.logprobs:
            # With explicit ids the natural top-k is not returned, so it is not computed either.
            logprobs = 0 if explicit else (self.top_logprobs or 0)
        return GenerationParams(
            messages=tuple(message.to_template() for message in self.messages),
            add_special_tokens=self.add_special_tokens,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=None if self.top_k is None else max(self.top_k, 0),
            seed=self.seed,
            stop=normalize_stop(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logprob_token_ids=explicit,
        )


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    """The token's real bytes from the model (may be part of a multi-byte character)."""


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb]


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
