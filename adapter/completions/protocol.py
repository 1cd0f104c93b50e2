"""Request and response models of POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from adapter.errors import InvalidRequestError
from adapter.protocol import (
    NON_EMPTY_LIST,
    VLLM_UNSUPPORTED,
    GenerationRequest,
    StopReason,
    UsageInfo,
    check_logprob_token_ids,
    check_min_tokens,
    check_token_ids,
    distinct,
    token_limit_or_default,
)
from adapter.tensors import TritonRequest

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for completions."""


def check_prompt_logprob_token_ids(
    ids: list[int] | None, *, echo: bool, logprobs: int | None
) -> None:
    """They show in the echoed prompt's `top_logprobs`, so they need both."""
    if ids is None:
        return
    param = "prompt_logprob_token_ids"
    if not ids:
        raise InvalidRequestError(f"`{param}` must not be empty.", parameter=param)
    if not echo or logprobs is None:
        raise InvalidRequestError(
            f"`{param}` requires `echo: true` and `logprobs` (0 allowed).", parameter=param
        )


class CompletionRequest(GenerationRequest):
    """The body of POST /v1/completions; the shared fields are in `GenerationRequest`."""

    # https://platform.openai.com/docs/api-reference/completions/create
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, a list of token ids, or a list of either (a batch: `n` choices "
        "per prompt, prompt i's at indices i*n to i*n+n-1)."
    )
    best_of: int | None = Field(default=None, description="Only 1 is supported.")
    echo: bool | None = Field(
        default=False,
        description="Return the prompt before the generated text; with `logprobs`, its tokens "
        "and their logprobs come first too (the first token's are null).",
    )
    logprobs: Annotated[int, Field(ge=0)] | None = Field(
        default=None,
        description="Return each token's logprob and this many top alternatives (at prompt "
        "positions too with `echo`).",
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        default=DEFAULT_MAX_TOKENS,
        description="Tokens to generate at most; 0 with `echo` scores the prompt only; null: "
        "up to the server's cap or the context, whichever is smaller (vLLM).",
    )
    suffix: str | None = Field(default=None, description="Not supported.")
    metadata: dict[str, Any] | None = Field(default=None, description="Accepted, not used.")

    # Our extension (SGLang's `input_token_ids_logprobs`)
    prompt_logprob_token_ids: list[int] | None = Field(
        default=None,
        json_schema_extra=NON_EMPTY_LIST,
        description="Token ids whose logprobs are returned at every prompt position; requires "
        "`echo` and `logprobs` (0 allowed). Each prompt position's `top_logprobs` then holds "
        "the prompt token first, then each distinct requested id other than it, in request "
        "order (the rule of `logprob_token_ids` at generated positions), instead of the "
        "natural top-k. Works with `max_tokens: 0`: scores a text against a label set "
        "without generating.",
    )

    unsupported: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        **VLLM_UNSUPPORTED,
        "best_of": (1,),
        "suffix": ("",),
        "use_beam_search": (False,),
    }

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        """Stable messages naming `prompt`, before pydantic tries the union's members."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise InvalidRequestError(
                "`prompt` must be a string or a list of token ids, or a list of either.",
                parameter="prompt",
            )
        if not value:
            raise InvalidRequestError("`prompt` must not be empty.", parameter="prompt")
        if all(isinstance(item, str) for item in value):
            return value
        if all(isinstance(item, list) for item in value):
            if not all(value):
                raise InvalidRequestError(
                    "`prompt` must not hold an empty token-id list.", parameter="prompt"
                )
            return [check_token_ids(ids, parameter="prompt") for ids in value]
        return check_token_ids(value, parameter="prompt")

    @field_validator("prompt_logprob_token_ids", mode="before")
    @classmethod
    def _check_prompt_token_ids(cls, value: Any) -> Any:
        return check_token_ids(value, parameter="prompt_logprob_token_ids")

    @model_validator(mode="after")
    def _check_request(self) -> CompletionRequest:
        check_logprob_token_ids(
            self.logprob_token_ids,
            logprobs_requested=self.logprobs is not None,
            requirement="`logprobs` (0 allowed)",
            generates=not (self.echo and self.max_tokens == 0),
            use_beam_search=bool(self.use_beam_search),
        )
        check_prompt_logprob_token_ids(
            self.prompt_logprob_token_ids, echo=bool(self.echo), logprobs=self.logprobs
        )
        check_min_tokens(self.min_tokens, self.max_tokens)
        self.reject_unsupported()
        return self

    def max_tokens_set(self) -> bool:
        """Whether the caller gave a number for `max_tokens`."""
        return "max_tokens" in self.model_fields_set and self.max_tokens is not None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch; a single one is a batch of one."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def to_generation_params(self, default_max_tokens: int | None) -> list[TritonRequest]:
        """The model's inputs, one per choice in `index` order: the user's value, else
        OpenAI's default, else the model's.

        `max_tokens` absent is OpenAI's 16; null is no limit of the request's own, as in
        vLLM: up to `default_max_tokens` (chat's default, `ChatCompletionRequest`).
        """
        sampling = self.sampling_params()
        # With explicit ids the natural top-k is not returned, so it is not computed either.
        logprobs = self.logprobs
        if logprobs is not None and sampling.logprob_token_ids:
            logprobs = 0
        prompt_explicit = distinct(self.prompt_logprob_token_ids)
        choices = []
        for prompt in self.prompts():
            text = prompt if isinstance(prompt, str) else None
            # Echo needs the prompt's tokens for their logprobs, or for the text of token ids.
            prompt_logprobs = None
            if self.echo and (self.logprobs is not None or text is None):
                prompt_logprobs = 0 if prompt_explicit or self.logprobs is None else self.logprobs
            params = replace(
                sampling,
                text=text,
                prompt_ids=None if isinstance(prompt, str) else tuple(prompt),
                max_tokens=token_limit_or_default(self.max_tokens, default_max_tokens),
                # A default stops at the context's end; a limit the caller set that does not
                # fit is a 400 (vLLM)
                max_tokens_parameter="max_tokens" if self.max_tokens_set() else None,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                prompt_logprob_token_ids=prompt_explicit,
            )
            choices.extend(self.samples(params))
        return choices


class CompletionLogProbs(BaseModel):
    """Legacy completions `logprobs`, one entry per token: with `echo` the prompt's first (its
    first token's logprob and `top_logprobs` null), then the generated ones. `text_offset`
    counts characters of the choice's text."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


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
    stop_reason: StopReason = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
