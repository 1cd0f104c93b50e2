"""Pydantic models and request rules shared by the completions and chat endpoints."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from adapter.errors import InvalidRequestError

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1

# vLLM request extensions (vllm/entrypoints/openai/protocol.py) that change the result and that
# the engine does not implement yet: accepted only at their neutral value, else a 400. An empty
# tuple means only null / absent is accepted.
VLLM_UNSUPPORTED: Mapping[str, tuple[Any, ...]] = {
    "min_p": (0,),
    "repetition_penalty": (1,),
    "length_penalty": (1,),
    "min_tokens": (0,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structural_tag": (),
    "structured_outputs": (),
    "logits_processors": (),
    "return_token_ids": (False,),
    "prompt_embeds": (),
    "vllm_xargs": (),
}


class OpenAIBaseModel(BaseModel):
    """Accepts unknown fields and logs them, so new SDK fields do not break clients.

    Known fields that would change the result and are not implemented are listed in
    `unsupported` (name -> accepted values) and rejected by `reject_unsupported`.
    """

    model_config = ConfigDict(extra="allow")

    unsupported: ClassVar[Mapping[str, tuple[Any, ...]]] = {}

    @model_validator(mode="after")
    def _log_ignored_fields(self) -> OpenAIBaseModel:
        ignored = sorted(set(self.model_extra or {}) - set(self.unsupported))
        if ignored:
            logger.warning("%s: ignoring unknown fields %s", type(self).__name__, ignored)
        return self

    def reject_unsupported(self) -> None:
        """400 naming the first field of `unsupported` set to a value the server cannot honour."""
        extra = self.model_extra or {}
        for name, accepted in self.unsupported.items():
            value = getattr(self, name) if name in type(self).model_fields else extra.get(name)
            if value is not None and value not in accepted:
                shown = " or ".join(repr(v) for v in accepted) or "null"
                raise InvalidRequestError(
                    f"`{name}` is not supported by this server (got {value!r}; only {shown}).",
                    parameter=name,
                    value=value,
                )


class StreamOptions(OpenAIBaseModel):
    """`stream_options` of both endpoints."""

    include_usage: bool | None = Field(
        default=None, description="Send a last chunk with `usage` and empty `choices`."
    )
    continuous_usage_stats: bool | None = Field(
        default=None, description="vLLM: `usage` on every chunk as well."
    )


class UsageInfo(BaseModel):
    """Token counts, taken from the model's PROMPT_TOKENS / COMPLETION_TOKENS."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def from_counts(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class ModelCard(BaseModel):
    """One entry of /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "triton-logprobs"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """The body of /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


def check_token_ids(values: Any, *, parameter: str) -> Any:
    """Pre-validation of a token-id list: integers in the INT32 range, no bools or floats.

    Runs before pydantic's own parsing so the message is stable and names the field; the
    vocabulary bound itself is checked by the model.
    """
    if values is None:
        return None
    if not isinstance(values, list):
        raise InvalidRequestError(
            f"`{parameter}` must be a list of token ids.", parameter=parameter
        )
    for value in values:
        if type(value) is not int:
            raise InvalidRequestError(
                f"`{parameter}` must contain only integer token ids, got {value!r}.",
                parameter=parameter,
                value=value,
            )
        if not 0 <= value <= INT32_MAX:
            raise InvalidRequestError(
                f"`{parameter}`: id {value} is outside the vocabulary.",
                parameter=parameter,
                value=value,
            )
    return values


def check_logprob_token_ids(
    ids: Sequence[int] | None,
    *,
    logprobs_requested: bool,
    requirement: str,
    generates: bool = True,
    use_beam_search: bool = False,
) -> None:
    """The request-only rules of `logprob_token_ids` (DESIGN §4); server limits come later."""
    if ids is None:
        return
    param = "logprob_token_ids"
    if not ids:
        raise InvalidRequestError("`logprob_token_ids` must not be empty.", parameter=param)
    if not logprobs_requested:
        raise InvalidRequestError(f"`logprob_token_ids` requires {requirement}.", parameter=param)
    if not generates:
        raise InvalidRequestError(
            "`logprob_token_ids` cannot be used with `echo: true` and `max_tokens: 0`: "
            "no token is generated.",
            parameter=param,
        )
    if use_beam_search:
        raise InvalidRequestError(
            "`logprob_token_ids` is not supported with beam search (`use_beam_search`).",
            parameter=param,
        )


def normalize_stop(stop: str | list[str] | None) -> tuple[str, ...]:
    """`stop` as a tuple of non-empty strings (an empty one would match everywhere)."""
    values = [stop] if isinstance(stop, str) else list(stop or ())
    if any(value == "" for value in values):
        raise InvalidRequestError("`stop` strings must not be empty.", parameter="stop")
    return tuple(values)


def check_stream_options(stream: bool | None, stream_options: StreamOptions | None) -> None:
    if stream_options is not None and not stream:
        raise InvalidRequestError(
            "`stream_options` is only allowed with `stream: true`.", parameter="stream_options"
        )


def distinct(ids: Sequence[int] | None) -> tuple[int, ...]:
    """Ids in first-seen order without repeats: one LOGPROB_TOKEN_LOGPROBS column per id."""
    return tuple(dict.fromkeys(ids or ()))
