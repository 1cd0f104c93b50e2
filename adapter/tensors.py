"""Generation params <-> Triton tensors: pure functions on numpy arrays (no server needed)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from adapter.errors import InvalidRequestError
from backend import contract
from backend.structured_output import StructuredOutput


@dataclass(frozen=True)
class TritonRequest:
    """One generation request in the models' terms; `None` / empty leaves the model's default.

    One prompt field is set, or `text` or `messages` with `prompt_ids` once they are tokenized
    (the text stays for `echo`); `prompt_ids` then go to `llm`. `logprob_token_ids` and
    `prompt_logprob_token_ids` hold distinct ids: column j of LOGPROB_TOKEN_LOGPROBS
    (PROMPT_LOGPROB_TOKEN_LOGPROBS) is then id j, with no duplicate columns to skip.
    Penalties, bias, allowed ids and min tokens change sampling only; the logprobs stay raw.
    """

    text: str | None = None
    """Completion prompt text (TEXT_INPUT of `preprocessing`)."""
    messages: tuple[Mapping[str, Any], ...] | None = None
    """Chat messages, for the chat template (MESSAGES of `preprocessing`)."""
    prompt_ids: tuple[int, ...] | None = None
    """Token-id prompt (INPUT_IDS of `llm`)."""
    add_special_tokens: bool | None = None
    """Text and chat prompts only (for the tokenizer)."""
    add_generation_prompt: bool | None = None
    """Chat only: end the rendered chat with the assistant's header (the model's default)."""
    continue_final_message: bool | None = None
    """Chat only: leave the final message open for the model to continue."""
    chat_template_kwargs: Mapping[str, Any] | None = None
    """Chat only: the template's own variables (CHAT_TEMPLATE_KWARGS of `preprocessing`)."""
    max_tokens: int | None = None
    max_tokens_parameter: str | None = None
    """The request field `max_tokens` came from, when the caller set it: then the prompt and
    `max_tokens` must fit the context (`check_fits_context`); else the model stops at its end."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """0 disables top-k."""
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    """EOS and stop ids cannot end the generation before this many tokens."""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(id, bias) pairs added to the logits before sampling."""
    allowed_token_ids: tuple[int, ...] = ()
    """Not empty: only these ids can be sampled."""
    logprobs: int | None = None
    """Natural top-k count; set (0 included) to get the sampled token's logprob."""
    logprob_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int | None = None
    """Natural top-k count at prompt positions; set (0 included) to get the prompt's ids, bytes
    and each token's logprob on the first response."""
    prompt_logprob_token_ids: tuple[int, ...] = ()
    structured_output: StructuredOutput | None = None
    """The shape the output must take (STRUCTURED_OUTPUT)."""

    def check_fits_context(self, prompt_tokens: int, max_model_len: int | None) -> None:
        """A 400 naming `max_tokens_parameter` when the prompt and `max_tokens` exceed the
        context, as vLLM's and OpenAI's servers answer. A prompt that fills the context alone is
        the model's error, which names the prompt."""
        if self.max_tokens_parameter is None or self.max_tokens is None or max_model_len is None:
            return
        if prompt_tokens < max_model_len < prompt_tokens + self.max_tokens:
            raise InvalidRequestError(
                f"`{self.max_tokens_parameter}` is too large: {self.max_tokens}. This model's "
                f"maximum context length is {max_model_len} tokens and your request has "
                f"{prompt_tokens} input tokens ({self.max_tokens} > {max_model_len} - "
                f"{prompt_tokens}).",
                parameter=self.max_tokens_parameter,
                value=self.max_tokens,
            )

    @property
    def needs_tokenizing(self) -> bool:
        """A text or chat prompt: `preprocessing` turns it into INPUT_IDS first."""
        return self.prompt_ids is None

    @property
    def output_names(self) -> tuple[str, ...]:
        """The `llm` outputs this request reads: the model builds only those, and a response
        without logprobs carries five small tensors rather than every one."""
        return contract.requested_outputs(
            logprobs=self.logprobs,
            token_ids=bool(self.logprob_token_ids),
            prompt_logprobs=self.prompt_logprobs is not None or bool(self.prompt_logprob_token_ids),
            stop_rules=bool(self.stop or self.stop_token_ids),
        )


def _scalar(value: float | bool, dtype: type[np.generic]) -> np.ndarray:
    return np.array([value], dtype=dtype)


def _strings(values: list[str] | tuple[str, ...]) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


def preprocessing_inputs(params: TritonRequest) -> dict[str, np.ndarray]:
    """The `preprocessing` model's inputs: the text or the chat messages as JSON."""
    if (params.text is None) == (params.messages is None):
        raise ValueError("preprocessing needs exactly one of text, messages")
    arrays: dict[str, np.ndarray] = {}
    if params.text is not None:
        arrays[contract.TEXT_INPUT] = _strings([params.text])
    else:
        messages = list(params.messages or ())
        arrays[contract.MESSAGES] = _strings([json.dumps(messages, ensure_ascii=False)])
    flags = [
        (contract.ADD_SPECIAL_TOKENS, params.add_special_tokens),
        (contract.ADD_GENERATION_PROMPT, params.add_generation_prompt),
        (contract.CONTINUE_FINAL_MESSAGE, params.continue_final_message),
    ]
    for name, flag in flags:
        if flag is not None:
            arrays[name] = _scalar(flag, np.bool_)
    if params.chat_template_kwargs is not None:
        kwargs = json.dumps(params.chat_template_kwargs, ensure_ascii=False)
        arrays[contract.CHAT_TEMPLATE_KWARGS] = _strings([kwargs])
    return arrays


def llm_inputs(
    params: TritonRequest, prompt_ids: Sequence[int] | np.ndarray
) -> dict[str, np.ndarray]:
    """The `llm` model's inputs, typed as its config declares them; unset options are left out."""
    arrays: dict[str, np.ndarray] = {contract.INPUT_IDS: np.asarray(prompt_ids, dtype=np.int32)}
    scalars: list[tuple[str, Any, type[np.generic]]] = [
        (contract.MAX_TOKENS, params.max_tokens, np.int32),
        (contract.TEMPERATURE, params.temperature, np.float32),
        (contract.TOP_P, params.top_p, np.float32),
        (contract.TOP_K, params.top_k, np.int32),
        (contract.MIN_P, params.min_p, np.float32),
        (contract.SEED, params.seed, np.int64),
        (contract.INCLUDE_STOP_STR_IN_OUTPUT, params.include_stop_str_in_output, np.bool_),
        (contract.IGNORE_EOS, params.ignore_eos, np.bool_),
        (contract.MIN_TOKENS, params.min_tokens, np.int32),
        (contract.PRESENCE_PENALTY, params.presence_penalty, np.float32),
        (contract.FREQUENCY_PENALTY, params.frequency_penalty, np.float32),
        (contract.REPETITION_PENALTY, params.repetition_penalty, np.float32),
        (contract.LOGPROBS, params.logprobs, np.int32),
        (contract.PROMPT_LOGPROBS, params.prompt_logprobs, np.int32),
    ]
    for name, value, dtype in scalars:
        if value is not None:
            arrays[name] = _scalar(value, dtype)
    if params.stop:
        arrays[contract.STOP] = _strings(params.stop)
    if params.structured_output is not None:
        arrays[contract.STRUCTURED_OUTPUT] = _strings([params.structured_output.to_json()])
    lists: list[tuple[str, Sequence[float], type[np.generic]]] = [
        (contract.STOP_TOKEN_IDS, params.stop_token_ids, np.int32),
        (contract.LOGIT_BIAS_IDS, [token for token, _ in params.logit_bias], np.int32),
        (contract.LOGIT_BIAS_VALUES, [bias for _, bias in params.logit_bias], np.float32),
        (contract.ALLOWED_TOKEN_IDS, params.allowed_token_ids, np.int32),
        (contract.LOGPROB_TOKEN_IDS, params.logprob_token_ids, np.int32),
        (contract.PROMPT_LOGPROB_TOKEN_IDS, params.prompt_logprob_token_ids, np.int32),
    ]
    for name, values, dtype in lists:
        if values:
            arrays[name] = np.array(values, dtype=dtype)
    return arrays


def to_infer_inputs(arrays: Mapping[str, np.ndarray]) -> list[grpcclient.InferInput]:
    """Wraps arrays as gRPC `InferInput`s, the Triton dtype taken from the numpy dtype."""
    inputs = []
    for name, array in arrays.items():
        infer_input = grpcclient.InferInput(
            name, list(array.shape), np_to_triton_dtype(array.dtype)
        )
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


@dataclass(frozen=True)
class LogprobRows:
    """Per-position logprob tables, laid out alike for generated and prompt positions."""

    logprobs: list[float]
    """Each position's token's logprob; [] for generated positions without LOGPROBS."""
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    top_token_bytes: list[list[bytes]]
    """The natural top-k per position (k = LOGPROBS, or PROMPT_LOGPROBS)."""
    requested_logprobs: list[list[float]]
    """Column j is explicit id j (LOGPROB_TOKEN_IDS, or PROMPT_LOGPROB_TOKEN_IDS)."""


@dataclass(frozen=True)
class PromptOutput(LogprobRows):
    """The prompt's tokens and their logprobs, sent once, with the first response.

    Row i-1 of each table scores prompt token i given the tokens before it (P = len(ids));
    the first token has no row.
    """

    ids: list[int]
    token_bytes: list[bytes]
    """[P], special tokens' text included."""
    requested_token_bytes: list[bytes]
    """[M]: the bytes of PROMPT_LOGPROB_TOKEN_IDS, whose column j is id j."""


@dataclass(frozen=True)
class TritonOutput(LogprobRows):
    """One streamed response of the model as plain Python values (n = len(output_ids)), its
    tables one row per new token."""

    output_ids: list[int]
    text: str
    """Text delta; stop strings are cut and a multi-byte character is never split."""
    token_bytes: list[bytes]
    """Each new token's raw bytes (possibly a partial UTF-8 sequence)."""
    requested_token_bytes: list[bytes]
    """[M] on the first response of a request, [] afterwards."""
    finish_reason: str | None
    """None until the final response, then the model's reason (`stop`, `length`, ...)."""
    prompt_tokens: int
    completion_tokens: int
    """Cumulative over the request."""
    final: bool
    prompt: PromptOutput | None = None
    """On the first response when prompt logprobs were asked for (PROMPT_LOGPROBS or
    PROMPT_LOGPROB_TOKEN_IDS), else None."""
    stop_reason: str | int | None = None
    """On the final response: the stop string or stop token id that ended it (STOP_REASON)."""

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray | None], *, final: bool) -> TritonOutput:
        """Reads a response's arrays; a missing output counts as empty."""

        def values(name: str) -> list[Any]:
            array = arrays.get(name)
            return [] if array is None else array.tolist()

        def count(name: str) -> int:
            array = arrays.get(name)
            return int(array.reshape(-1)[0]) if array is not None and array.size else 0

        def text(name: str) -> str:
            array = arrays.get(name)
            raw = b"" if array is None else b"".join(array.reshape(-1).tolist())
            return raw.decode("utf-8", errors="replace")

        def rows(
            logprobs: str, top_ids: str, top_logprobs: str, top_token_bytes: str, requested: str
        ) -> dict[str, list[Any]]:
            """The `LogprobRows` fields from these tensors. The top-k's [n, k] tables, when not
            asked for (`contract.requested_outputs`: not with LOGPROBS=0), are n empty rows."""
            positions = values(logprobs)

            def top(name: str) -> list[Any]:
                return values(name) if name in arrays else [[] for _ in positions]

            return {
                "logprobs": positions,
                "top_ids": top(top_ids),
                "top_logprobs": top(top_logprobs),
                "top_token_bytes": top(top_token_bytes),
                "requested_logprobs": values(requested),
            }

        stop_reason = text(contract.STOP_REASON)  # "" until the final response, then JSON
        prompt_ids = values(contract.PROMPT_IDS)
        prompt = None
        if prompt_ids:
            prompt = PromptOutput(
                ids=prompt_ids,
                token_bytes=values(contract.PROMPT_TOKEN_BYTES),
                requested_token_bytes=values(contract.PROMPT_LOGPROB_TOKEN_BYTES),
                **rows(
                    contract.PROMPT_TOKEN_LOGPROBS,
                    contract.PROMPT_TOP_LOGPROB_IDS,
                    contract.PROMPT_TOP_LOGPROBS,
                    contract.PROMPT_TOP_LOGPROB_TOKEN_BYTES,
                    contract.PROMPT_LOGPROB_TOKEN_LOGPROBS,
                ),
            )
        return cls(
            output_ids=values(contract.OUTPUT_IDS),
            text=text(contract.TEXT_OUTPUT),
            token_bytes=values(contract.OUTPUT_TOKEN_BYTES),
            **rows(
                contract.OUTPUT_LOGPROBS,
                contract.TOP_LOGPROB_IDS,
                contract.TOP_LOGPROBS,
                contract.TOP_LOGPROB_TOKEN_BYTES,
                contract.LOGPROB_TOKEN_LOGPROBS,
            ),
            requested_token_bytes=values(contract.LOGPROB_TOKEN_BYTES),
            finish_reason=text(contract.FINISH_REASON) or None,
            prompt_tokens=count(contract.PROMPT_TOKENS),
            completion_tokens=count(contract.COMPLETION_TOKENS),
            final=final,
            prompt=prompt,
            stop_reason=json.loads(stop_reason) if stop_reason else None,
        )
