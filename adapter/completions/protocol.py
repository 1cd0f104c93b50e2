"""Request and response models of POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from adapter.errors import InvalidRequestError
from adapter.protocol import (
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

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for completions."""


class CompletionRequest(OpenAIBaseModel):
    """The body of POST /v1/completions."""

    # https://platform.openai.com/docs/api-reference/completions/create
    model: str | None = Field(default=None, description="Served model id; null: the only one.")
    prompt: str | list[int] = Field(
        description="A string, or a list of token ids (a one-element batch is unwrapped)."
    )
    best_of: int | None = Field(default=None, description="Only 1 is supported.")
    echo: bool | None = Field(default=False, description="Not supported yet.")
    frequency_penalty: float | None = Field(default=0.0, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(default=None, description="Not supported yet.")
    logprobs: Annotated[int, Field(ge=0)] | None = Field(
        default=None,
        description="Return the sampled token's logprob and this many top alternatives.",
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        default=DEFAULT_MAX_TOKENS, description="Tokens to generate at most."
    )
    n: int | None = Field(default=1, description="Only 1 is supported.")
    presence_penalty: float | None = Field(default=0.0, description="Only 0 is supported.")
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | list[str] | None = Field(default=None, description="Stop strings, not returned.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = Field(default=None, description="Not supported.")
    temperature: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="0 is greedy; null: 1.0."
    )
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = Field(default=None, description="Accepted, not used.")

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
        "`top_logprobs` after the sampled token; requires `logprobs` (0 allowed).",
    )
    return_tokens_as_token_ids: bool | None = Field(
        default=None, description='Tokens as "token_id:N" instead of text.'
    )
    add_special_tokens: bool | None = Field(
        default=None, description="Tokenize a text prompt with BOS etc.; null: true."
    )

    unsupported: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        **VLLM_UNSUPPORTED,
        "best_of": (1,),
        "echo": (False,),
        "frequency_penalty": (0,),
        "logit_bias": ({},),
        "n": (1,),
        "presence_penalty": (0,),
        "suffix": ("",),
        "use_beam_search": (False,),
        "response_format": ({"type": "text"},),
    }

    @field_validator("prompt", mode="before")
    @classmethod
    def _unwrap_prompt(cls, value: Any) -> Any:
        """One prompt per request for now: a batch of one is unwrapped, larger ones are 400."""
        if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
            if len(value) > 1:
                raise InvalidRequestError(
                    f"`prompt` holds {len(value)} prompts; send one prompt per request.",
                    parameter="prompt",
                )
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            if not value:
                raise InvalidRequestError("`prompt` must not be empty.", parameter="prompt")
            return check_token_ids(value, parameter="prompt")
        raise InvalidRequestError(
            "`prompt` must be a string or a list of token ids.", parameter="prompt"
        )

    @field_validator("logprob_token_ids", "stop_token_ids", mode="before")
    @classmethod
    def _check_token_ids(cls, value: Any, info: ValidationInfo) -> Any:
        return check_token_ids(value, parameter=info.field_name)

    @model_validator(mode="after")
    def _check_request(self) -> CompletionRequest:
        check_logprob_token_ids(
            self.logprob_token_ids,
            logprobs_requested=self.logprobs is not None,
            requirement="`logprobs` (0 allowed)",
            generates=not (self.echo and self.max_tokens == 0),
            use_beam_search=bool(self.use_beam_search),
        )
        self.reject_unsupported()
        check_stream_options(self.stream, self.stream_options)
        return self

    def to_generation_params(self) -> GenerationParams:
        """The model's inputs: the user's value, else OpenAI's default, else the model's."""
        explicit = distinct(self.logprob_token_ids)
        return GenerationParams(
            text=self.prompt if isinstance(self.prompt, str) else None,
            prompt_ids=None if isinstance(self.prompt, str) else tuple(self.prompt),
            add_special_tokens=self.add_special_tokens,
            max_tokens=DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=None if self.top_k is None else max(self.top_k, 0),
            seed=self.seed,
            stop=normalize_stop(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            # With explicit ids the natural top-k is not returned, so it is not computed either.
            logprobs=None if self.logprobs is None else (0 if explicit else self.logprobs),
            logprob_token_ids=explicit,
        )


class CompletionLogProbs(BaseModel):
    """Legacy completions `logprobs`; `text_offset` counts characters of the generated text."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
