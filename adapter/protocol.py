"""Pydantic models and request rules shared by the completions and chat endpoints."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from adapter.errors import InvalidRequestError
from adapter.tensors import TritonOutput, TritonRequest
from backend.structured_output import (
    CHOICE,
    GRAMMAR,
    JSON_OBJECT,
    REGEX,
    TOO_DEEP,
    StructuredOutput,
)

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
NON_EMPTY_LIST: dict[str, Any] = {"minItems": 1}
"""`json_schema_extra` of an optional list that must not be empty: the schema says so, while
the validator keeps its own message (pydantic writes `minLength` for a union, which fuzzers and
clients read as a string rule)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: a field sent as a float32 tensor holds inf beyond it."""

# vLLM request extensions (vllm/entrypoints/openai/protocol.py) that change the result and that
# the engine does not implement yet: accepted only at their neutral value, else a 400. An empty
# tuple means only null / absent is accepted.
VLLM_UNSUPPORTED: Mapping[str, tuple[Any, ...]] = {
    "length_penalty": (1,),
    "skip_special_tokens": (True,),
    # Either value: special tokens are always skipped, so no text lies between them (vLLM's
    # fast-tokenizer path ignores it too).
    "spaces_between_special_tokens": (True, False),
    "truncate_prompt_tokens": (),
    "bad_words": ([],),
    "prompt_logprobs": (),  # completions: `echo` with `logprobs` returns them
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structural_tag": (),
    "logits_processors": (),
    "return_token_ids": (False,),
    "prompt_embeds": (),
    "vllm_xargs": (),
}


_SCALARS = {int, float, bool, type(None)}
"""JSON values that hold no text."""


MAX_NESTING = 128
"""How deep a request body may nest lists and objects, the body itself one level: far below
Python's recursion limit, which the walks after the parser's (this module's, the `json.dumps` of
template variables for Triton, the chat template's) would otherwise reach first, as a 500
(the parser itself refuses about 965 levels)."""


class BodyFault(NamedTuple):
    """Where a parsed body holds what the server cannot take (`path`: keys and list indexes)."""

    path: tuple[str, ...]
    too_deep: bool
    """Nested deeper than `MAX_NESTING`; else a lone surrogate."""


def body_fault_at(value: Any, path: tuple[str, ...] = ()) -> BodyFault | None:
    """The first place in parsed JSON that holds lists and objects nested deeper than
    `MAX_NESTING`, or a string (or a key) with a lone UTF-16 surrogate, or None. JSON can escape
    one (`"\\ud800"`), but no Unicode text holds it, and encoding it fails later."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return BodyFault(path, too_deep=False)
        return None
    if isinstance(value, dict | list) and len(path) >= MAX_NESTING:
        return BodyFault(path, too_deep=True)
    if isinstance(value, dict):
        for key, item in value.items():
            # A key may hold the surrogate itself: the path escapes it, so the error can be sent.
            where = (*path, str(key).encode("utf-8", "backslashreplace").decode())
            for found in (body_fault_at(key, where), body_fault_at(item, where)):
                if found is not None:
                    return found
    elif isinstance(value, list) and not set(map(type, value)) <= _SCALARS:  # ids: in C
        for index, item in enumerate(value):
            found = body_fault_at(item, (*path, str(index)))
            if found is not None:
                return found
    return None


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

    def reject_unsupported(self, parent: str | None = None) -> None:
        """400 naming the first field of `unsupported` set to a value the server cannot honour;
        `parent`: the request field this object is the value of, then the error's `param`."""
        extra = self.model_extra or {}
        for name, accepted in self.unsupported.items():
            value = getattr(self, name) if name in type(self).model_fields else extra.get(name)
            if value is not None and value not in accepted:
                shown = " or ".join(repr(v) for v in accepted) or "null"
                where = name if parent is None else f"{parent}.{name}"
                raise InvalidRequestError(
                    f"`{where}` is not supported by this server (got {value!r}; only {shown}).",
                    parameter=parent or name,
                    value=value,
                )


class OpenAIRequest(OpenAIBaseModel):
    """A whole request body: walked once for nesting and text Triton could not take, before any
    field (its nested objects are `OpenAIBaseModel`s, which the walk has covered)."""

    @model_validator(mode="before")
    @classmethod
    def _reject_body_faults(cls, data: Any) -> Any:
        """A 400 naming the field, where a later walk or encoding for Triton would raise a 500."""
        fault = body_fault_at(data)
        if fault is None:
            return data
        where = fault.path
        if fault.too_deep:
            message = f"`{where[0]}` nests lists and objects more than {MAX_NESTING} levels deep."
        else:
            message = (
                f"`{'.'.join(where) or 'the body'}` holds a lone UTF-16 surrogate escape, "
                "which is not valid Unicode text."
            )
        raise InvalidRequestError(message, parameter=where[0] if where else None)


class StreamOptions(OpenAIBaseModel):
    """`stream_options` of both endpoints."""

    include_usage: bool | None = Field(
        default=None, description="Send a last chunk with `usage` and empty `choices`."
    )
    continuous_usage_stats: bool | None = Field(
        default=None, description="vLLM: with `include_usage`, `usage` on every chunk too."
    )


def json_type(value: Any) -> str:
    """The JSON name of the type of a value parsed from JSON, for messages."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def check_schema_object(schema: Any, where: str, *, parameter: str) -> dict[str, Any]:
    """A JSON schema must be an object: a 400 naming `where` otherwise (OpenAI's rule; a boolean
    schema is JSON Schema but not what any client means)."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            f"`{where}` must be a JSON schema object, got {json_type(schema)}.",
            parameter=parameter,
        )
    return schema


class JsonSchemaFormat(OpenAIBaseModel):
    """`response_format.json_schema` (OpenAI's structured outputs)."""

    name: str = Field(description="The schema's name; not used.")
    description: str | None = Field(default=None, description="Not used.")
    schema_: dict[str, Any] = Field(
        alias="schema", description="The JSON schema the output must match."
    )
    strict: bool | None = Field(default=None, description="Accepted; the schema always holds.")


class ResponseFormatText(OpenAIBaseModel):
    """`{"type": "text"}`: free text, as without `response_format`."""

    type: Literal["text"]

    def to_structured_output(self) -> StructuredOutput | None:
        return None


class ResponseFormatJsonObject(OpenAIBaseModel):
    """`{"type": "json_object"}`: any JSON object."""

    type: Literal["json_object"]

    def to_structured_output(self) -> StructuredOutput | None:
        return StructuredOutput(JSON_OBJECT, "")


class ResponseFormatJsonSchema(OpenAIBaseModel):
    """`{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`: JSON that
    matches the schema (what the openai SDK's `parse(response_format=Model)` sends)."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat

    @model_validator(mode="before")
    @classmethod
    def _check_json_schema(cls, value: Any) -> Any:
        """Stable messages naming `response_format`: pydantic's would repeat the union's tag in
        the path (`response_format.json_schema.json_schema.schema`)."""
        if not isinstance(value, dict):
            return value
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise InvalidRequestError(
                '`response_format` of type "json_schema" needs `json_schema.schema`.',
                parameter="response_format",
            )
        if not isinstance(spec.get("name"), str):
            raise InvalidRequestError(
                "`response_format.json_schema.name` must be a string.",
                parameter="response_format",
            )
        check_schema_object(
            spec["schema"], "response_format.json_schema.schema", parameter="response_format"
        )
        return value

    def to_structured_output(self) -> StructuredOutput | None:
        try:
            return StructuredOutput.json_schema(self.json_schema.schema_)
        except ValueError as exc:
            raise InvalidRequestError(
                f"`response_format`: {exc}", parameter="response_format"
            ) from None


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
"""The `type` tags of `ResponseFormat`'s members."""
ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]
"""`response_format`: free text, any JSON object, or JSON that matches a schema."""


class StructuredOutputsParams(OpenAIBaseModel):
    """vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`,
    `json_object`."""

    json_: dict[str, Any] | str | None = Field(
        default=None, alias="json", description="A JSON schema (or its JSON text)."
    )
    regex: str | None = Field(default=None, description="The output fully matches it.")
    choice: list[str] | None = Field(
        default=None, description="The output is one of these.", json_schema_extra=NON_EMPTY_LIST
    )
    grammar: str | None = Field(default=None, description="An EBNF (GBNF) grammar.")
    json_object: bool | None = Field(default=None, description="Any JSON object.")
    disable_any_whitespace: bool | None = Field(
        default=None, description="JSON kinds: no free whitespace (small models then finish)."
    )

    unsupported: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        "disable_fallback": (False,),
        "disable_additional_properties": (False,),
        "whitespace_pattern": (),
        "structural_tag": (),
    }

    @field_validator("json_", mode="before")
    @classmethod
    def _parse_schema(cls, value: Any) -> Any:
        """The schema as an object, from its JSON text too (vLLM takes both): anything but an
        object is a 400 here, not a compile error from the model."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(
                    f"`structured_outputs.json` is not valid JSON: {exc}.",
                    parameter="structured_outputs",
                ) from None
            except RecursionError:
                raise InvalidRequestError(
                    f"`structured_outputs.json`: {TOO_DEEP}.", parameter="structured_outputs"
                ) from None
        return check_schema_object(value, "structured_outputs.json", parameter="structured_outputs")

    def to_structured_output(self) -> StructuredOutput:
        param = "structured_outputs"
        self.reject_unsupported(parent=param)
        unknown = sorted(set(self.model_extra or ()) - set(self.unsupported))
        if unknown:  # vLLM's dataclass refuses them too: a misspelt flag must not be lost
            raise InvalidRequestError(
                f"`structured_outputs.{unknown[0]}` is not a field of `structured_outputs`.",
                parameter=param,
            )
        kinds = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object,  # false too, as in vLLM: one kind, or a typo
        }
        given = [name for name, value in kinds.items() if value is not None]
        if len(given) != 1:
            raise InvalidRequestError(
                "`structured_outputs` takes exactly one of `json`, `regex`, `choice`, `grammar` "
                f"and `json_object`; got {len(given)}"
                + (f" ({', '.join(given)})." if given else "."),
                parameter=param,
            )
        if self.json_object is False:
            raise InvalidRequestError(
                "`structured_outputs.json_object: false` constrains nothing; leave "
                "`structured_outputs` out for free text.",
                parameter=param,
            )
        whitespace = bool(self.disable_any_whitespace)
        try:
            if self.json_ is not None:
                return StructuredOutput.json_schema(self.json_, whitespace)
            if self.json_object:
                return StructuredOutput(JSON_OBJECT, "", whitespace)
            if self.choice is not None:
                return StructuredOutput(CHOICE, tuple(self.choice), whitespace)
            if self.regex is not None:
                return StructuredOutput(REGEX, self.regex, whitespace)
            return StructuredOutput(GRAMMAR, self.grammar, whitespace)
        except ValueError as exc:
            raise InvalidRequestError(f"`structured_outputs`: {exc}", parameter=param) from None


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

    @classmethod
    def from_choices(cls, finals: Sequence[TritonOutput], n: int) -> UsageInfo:
        """The sum over a request's choices, `n` per prompt: each prompt counts once (vLLM)."""
        return cls.from_counts(
            sum(final.prompt_tokens for final in finals[::n]),
            sum(final.completion_tokens for final in finals),
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
    """The request-only rules of `logprob_token_ids` (docs/design.md, "Logprob semantics");
    server limits come later."""
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


def token_limit_or_default(limit: int | None, default_max_tokens: int | None) -> int:
    """The request's own token limit, else the server's default (`default_max_tokens`: its cap
    or the context, whichever is smaller; None: the model's own context, which INT32_MAX
    reaches)."""
    return (default_max_tokens or INT32_MAX) if limit is None else limit


def check_min_tokens(min_tokens: int | None, max_tokens: int | None) -> None:
    """vLLM's rule: at most `max_tokens` (when the request sets a limit)."""
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequestError(
            f"`min_tokens` ({min_tokens}) must be at most the token limit ({max_tokens}).",
            parameter="min_tokens",
            value=min_tokens,
        )


ChatTemplateKwargs = Annotated[
    dict[str, Any] | None,
    Field(
        description='vLLM: the chat template\'s own variables, e.g. `{"enable_thinking": false}` '
        "for Qwen3; keys the template does not read are dropped."
    ),
]
"""vLLM's `chat_template_kwargs`, on chat and on `/tokenize` with `messages`."""


def check_chat_template_flags(
    add_generation_prompt: bool | None, continue_final_message: bool | None
) -> None:
    """vLLM's rule: the final message is continued or a new one started, not both."""
    if continue_final_message and add_generation_prompt is not False:
        raise InvalidRequestError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to true.",
            parameter="continue_final_message",
            value=continue_final_message,
        )


StopReason = Annotated[
    int | str | None,
    Field(
        description="vLLM: the stop string or stop token id that ended the choice; null for "
        "EOS, a completed structured output or the token limit."
    ),
]
"""vLLM's `stop_reason` of a choice (STOP_REASON); in a stream, set on the choice's last chunk."""

Penalty = Annotated[float, Field(ge=-2, le=2)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
LogitBias = Annotated[float, Field(ge=-100, le=100)]


class GenerationRequest(OpenAIRequest):
    """What chat and completions requests share, and its conversion (`sampling_params`).

    OpenAI's common fields come first, in the API reference's order, then vLLM's sampling
    extensions; each endpoint's own fields follow in its subclass.
    """

    # https://platform.openai.com/docs/api-reference/completions/create, .../chat/create
    model: str | None = Field(default=None, description="Served model id; null: the only one.")
    frequency_penalty: Penalty | None = Field(
        default=0.0,
        description="Subtracted from each id's logit once per time the id was generated.",
    )
    logit_bias: dict[str, LogitBias] | None = Field(
        default=None,
        description="Token id (a string, as JSON keys are) -> bias in [-100, 100] added to its "
        "logit before sampling; the reported logprobs stay raw.",
    )
    n: Annotated[int, Field(ge=1, le=128)] | None = Field(
        default=1,
        description="Independent samples of each prompt, all generated together; with `seed`, "
        "sample i uses seed + i.",
    )
    presence_penalty: Penalty | None = Field(
        default=0.0,
        description="Subtracted once from the logit of each id generated at least once.",
    )
    seed: Seed | None = Field(default=None, description="Same seed, same tokens; null: random.")
    stop: str | list[str] | None = Field(
        default=None,
        description="Stop strings: the text ends before the first one (after it with "
        "`include_stop_str_in_output`).",
    )
    stream: bool | None = Field(
        default=False, description="Server-sent events: a chunk per model response and choice."
    )
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="0 is greedy; null: 1.0."
    )
    top_p: Annotated[float, Field(gt=0, le=1)] | None = Field(
        default=None, description="Nucleus sampling; null: 1.0."
    )
    user: str | None = Field(default=None, description="Accepted, not used.")

    # vLLM extensions (vllm/entrypoints/openai/protocol.py)
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = Field(
        default=None, description="Sample from the k most likely tokens; -1 or 0: off."
    )
    min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(
        default=None,
        description="After temperature, drop the ids less probable than min_p times the most "
        "probable one's; 0: off.",
    )
    repetition_penalty: Annotated[float, Field(gt=0)] | None = Field(
        default=None,
        description="The logits of ids in the prompt or the output: positive ones divided by "
        "it, negative ones multiplied; 1: off.",
    )
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = Field(
        default=None, description="EOS and `stop_token_ids` cannot end the text before this."
    )
    stop_token_ids: list[int] | None = Field(
        default=None,
        description="Token ids that end the generation: the id and its logprobs are "
        "returned, its text only with `include_stop_str_in_output`.",
    )
    include_stop_str_in_output: bool | None = Field(
        default=None, description="Keep the stop string at the end of the text."
    )
    ignore_eos: bool | None = Field(default=None, description="Keep generating after EOS.")
    allowed_token_ids: list[int] | None = Field(
        default=None, description="Only these ids can be sampled.", json_schema_extra=NON_EMPTY_LIST
    )
    use_beam_search: bool | None = Field(default=False, description="Not supported.")
    logprob_token_ids: list[int] | None = Field(
        default=None,
        json_schema_extra=NON_EMPTY_LIST,
        description="Token ids whose logprobs are returned at every generated position, in "
        "`top_logprobs` after the sampled token (which comes once, first); requires `logprobs`.",
    )
    return_tokens_as_token_ids: bool | None = Field(
        default=None, description='Tokens as "token_id:N" instead of text.'
    )
    add_special_tokens: bool | None = Field(
        default=None,
        description="Tokenize with BOS etc.; null: true for a text prompt, false for chat (the "
        "template adds its own).",
    )
    response_format: ResponseFormat | None = Field(
        default=None,
        description='`{"type": "json_object"}` or `{"type": "json_schema", "json_schema": '
        '{"name": ..., "schema": ...}}` holds the output to JSON (xgrammar); "text": free.',
    )
    structured_outputs: StructuredOutputsParams | None = Field(
        default=None,
        description="vLLM: the output's shape, one of `json`, `regex`, `choice`, `grammar`, "
        "`json_object`.",
    )

    @property
    def structured_output_parameter(self) -> str:
        """The field a STRUCTURED_OUTPUT error names."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def structured_output(self) -> StructuredOutput | None:
        """From `structured_outputs` or a non-text `response_format`, not both."""
        from_format = self.response_format.to_structured_output() if self.response_format else None
        if self.structured_outputs is None:
            return from_format
        if from_format is not None:
            raise InvalidRequestError(
                "Use `response_format` or `structured_outputs`, not both.",
                parameter="structured_outputs",
            )
        return self.structured_outputs.to_structured_output()

    @field_validator("response_format", mode="before")
    @classmethod
    def _check_response_format_type(cls, value: Any) -> Any:
        """A stable message for an unknown or missing `type`, before the union picks a member
        by it."""
        if isinstance(value, dict) and value.get("type") not in RESPONSE_FORMAT_TYPES:
            shown = ", ".join(f'"{kind}"' for kind in RESPONSE_FORMAT_TYPES)
            raise InvalidRequestError(
                f"`response_format.type` must be one of {shown}; got {value.get('type')!r}.",
                parameter="response_format",
                value=value.get("type"),
            )
        return value

    @field_validator("temperature", "repetition_penalty")
    @classmethod
    def _check_float32(cls, value: float | None, info: ValidationInfo) -> float | None:
        """The fields without an upper bound of their own that go as float32 tensors."""
        if value is not None and value > FLOAT32_MAX:
            raise InvalidRequestError(
                f"`{info.field_name}` must be at most {FLOAT32_MAX:.7g} (a float32); "
                f"got {value:g}.",
                parameter=info.field_name,
                value=value,
            )
        return value

    @field_validator("stop_token_ids", "allowed_token_ids", "logprob_token_ids", mode="before")
    @classmethod
    def _check_token_ids(cls, value: Any, info: ValidationInfo) -> Any:
        return check_token_ids(value, parameter=info.field_name or "")

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """The keys are token ids written as strings (JSON object keys)."""
        for key in value or {}:
            try:
                token_id = int(key)
            except ValueError:
                token_id = -1
            if not 0 <= token_id <= INT32_MAX:
                raise InvalidRequestError(
                    f"`logit_bias` keys must be token ids, got {key!r}.",
                    parameter="logit_bias",
                    value=key,
                )
        return value

    @model_validator(mode="after")
    def _check_generation(self) -> GenerationRequest:
        if self.allowed_token_ids == []:
            raise InvalidRequestError(
                "`allowed_token_ids` must not be empty.", parameter="allowed_token_ids"
            )
        check_stream_options(self.stream, self.stream_options)
        self.structured_output()  # its 400s now, before any model call
        return self

    def sampling_params(self) -> TritonRequest:
        """The params both endpoints fill alike (null leaves the model's default); the endpoint
        adds the prompt, the token limit and the logprob counts."""
        return TritonRequest(
            add_special_tokens=self.add_special_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=None if self.top_k is None else max(self.top_k, 0),
            min_p=self.min_p,
            seed=self.seed,
            stop=normalize_stop(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple((int(key), bias) for key, bias in (self.logit_bias or {}).items()),
            allowed_token_ids=tuple(self.allowed_token_ids or ()),
            logprob_token_ids=distinct(self.logprob_token_ids),
            structured_output=self.structured_output(),
        )

    def samples(self, params: TritonRequest) -> list[TritonRequest]:
        """`n` requests for one prompt, one a choice: sample i gets seed + i (wrapping in int64),
        so each is reproducible and they differ."""
        n = self.n or 1
        if params.seed is None:
            return [params] * n
        span = INT64_MAX - INT64_MIN + 1
        return [
            replace(params, seed=(params.seed + i - INT64_MIN) % span + INT64_MIN) for i in range(n)
        ]
