"""The `llm` model's numpy arrays <-> engine params and outputs, by the tensor names of
`backend.contract`."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

import numpy as np

from backend.contract import (
    ALLOWED_TOKEN_IDS,
    CANCEL,
    COMPLETION_TOKENS,
    FINISH_REASON,
    FREQUENCY_PENALTY,
    IGNORE_EOS,
    INCLUDE_STOP_STR_IN_OUTPUT,
    INPUT_IDS,
    LOGIT_BIAS_IDS,
    LOGIT_BIAS_VALUES,
    LOGPROB_TOKEN_BYTES,
    LOGPROB_TOKEN_IDS,
    LOGPROB_TOKEN_LOGPROBS,
    LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STRUCTURED_OUTPUT_CHARS,
    MAX_TOKENS,
    MIN_P,
    MIN_TOKENS,
    NEG_INF_LOGPROB,
    OUTPUT_IDS,
    OUTPUT_LOGPROBS,
    OUTPUT_TOKEN_BYTES,
    PRESENCE_PENALTY,
    PROMPT_IDS,
    PROMPT_LOGPROB_TOKEN_BYTES,
    PROMPT_LOGPROB_TOKEN_IDS,
    PROMPT_LOGPROB_TOKEN_LOGPROBS,
    PROMPT_LOGPROBS,
    PROMPT_OUTPUTS,
    PROMPT_TOKEN_BYTES,
    PROMPT_TOKEN_LOGPROBS,
    PROMPT_TOKENS,
    PROMPT_TOP_LOGPROB_IDS,
    PROMPT_TOP_LOGPROB_TOKEN_BYTES,
    PROMPT_TOP_LOGPROBS,
    REPETITION_PENALTY,
    SEED,
    STOP,
    STOP_REASON,
    STOP_TOKEN_IDS,
    STRUCTURED_OUTPUT,
    TEMPERATURE,
    TEXT_OUTPUT,
    TOP_K,
    TOP_LOGPROB_IDS,
    TOP_LOGPROB_TOKEN_BYTES,
    TOP_LOGPROBS,
    TOP_P,
)
from backend.params import EngineLimits, GenerationParams, InvalidInputError
from backend.structured_output import StructuredOutput

if TYPE_CHECKING:
    from backend.outputs import PromptLogprobs, StepOutput


def _scalar(arrays: Mapping[str, np.ndarray], name: str, kind: str):
    """The single element of an optional `[1]` input, or None when absent."""
    value = arrays.get(name)
    if value is None:
        return None
    value = np.asarray(value)
    if value.size != 1:
        raise InvalidInputError(name, f"expected one element, got shape {list(value.shape)}")
    if value.dtype.kind not in kind:
        raise InvalidInputError(name, f"unexpected dtype {value.dtype}")
    return value.reshape(-1)[0].item()


def _int_list(arrays: Mapping[str, np.ndarray], name: str) -> list[int] | None:
    value = arrays.get(name)
    if value is None:
        return None
    value = np.asarray(value)
    if value.dtype.kind not in "iu":
        raise InvalidInputError(name, f"expected integer token ids, got dtype {value.dtype}")
    if value.ndim != 1:
        raise InvalidInputError(name, f"expected a 1-D tensor, got shape {list(value.shape)}")
    return value.astype(np.int64).tolist()


def _check_ids(name: str, ids: list[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise InvalidInputError(name, f"id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def _strings(arrays: Mapping[str, np.ndarray], name: str) -> list[str]:
    value = arrays.get(name)
    if value is None:
        return []
    try:
        return [
            v.decode("utf-8") if isinstance(v, bytes) else str(v)
            for v in np.asarray(value, dtype=object).reshape(-1)
        ]
    except UnicodeDecodeError as exc:
        raise InvalidInputError(name, "is not valid UTF-8") from exc


def cancel_target(arrays: Mapping[str, np.ndarray], request_id: str) -> str | None:
    """The id of the request in flight that a CANCEL request ends (its own id), or None for a
    request to generate; raises InvalidInputError."""
    if not _scalar(arrays, CANCEL, "b"):
        return None
    if not request_id:
        raise InvalidInputError(CANCEL, "needs the id of the request to cancel as its request id")
    return request_id


def parse_request(
    arrays: Mapping[str, np.ndarray], limits: EngineLimits, request_id: str = ""
) -> GenerationParams:
    """Input tensors of one request -> validated params; raises InvalidInputError."""
    prompt = _int_list(arrays, INPUT_IDS)
    if prompt is None:  # optional in config.pbtxt for CANCEL requests only
        raise InvalidInputError(INPUT_IDS, "is required")
    if not prompt:
        raise InvalidInputError(
            INPUT_IDS, "the prompt is empty (through the ensemble: TEXT_INPUT gave no token ids)"
        )
    _check_ids(INPUT_IDS, prompt, limits.vocab_size)
    if len(prompt) >= limits.max_model_len:
        raise InvalidInputError(
            INPUT_IDS,
            f"the prompt has {len(prompt)} tokens, this model's maximum context length is "
            f"{limits.max_model_len} tokens: "
            f"at most {limits.max_model_len - 1} leave room for a token to generate",
        )
    params = GenerationParams(prompt_ids=prompt, request_id=request_id)
    for name, value in limits.sampling_defaults:
        setattr(params, name, value)

    max_tokens = _scalar(arrays, MAX_TOKENS, "iu")
    if max_tokens is not None:
        if max_tokens < 0:
            raise InvalidInputError(MAX_TOKENS, f"must be >= 0, got {max_tokens}")
        params.max_tokens = max_tokens
    if limits.max_new_tokens is not None:
        params.max_tokens = min(params.max_tokens, limits.max_new_tokens)
    temperature = _scalar(arrays, TEMPERATURE, "f")
    if temperature is not None:
        if not 0.0 <= temperature < float("inf"):
            raise InvalidInputError(TEMPERATURE, f"must be >= 0, got {temperature}")
        params.temperature = temperature
    top_p = _scalar(arrays, TOP_P, "f")
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise InvalidInputError(TOP_P, f"must be in (0, 1], got {top_p}")
        params.top_p = top_p
    top_k = _scalar(arrays, TOP_K, "iu")
    if top_k is not None:
        if top_k < -1:
            raise InvalidInputError(TOP_K, f"must be >= 0 (or -1 for off), got {top_k}")
        params.top_k = max(top_k, 0)
    min_p = _scalar(arrays, MIN_P, "f")
    if min_p is not None:
        if not 0.0 <= min_p <= 1.0:
            raise InvalidInputError(MIN_P, f"must be in [0, 1], got {min_p}")
        params.min_p = min_p
    params.seed = _scalar(arrays, SEED, "iu")
    params.stop = _stop_strings(arrays)
    stop_ids = _int_list(arrays, STOP_TOKEN_IDS) or []
    _check_ids(STOP_TOKEN_IDS, stop_ids, limits.vocab_size)
    params.stop_token_ids = stop_ids
    ignore_eos = _scalar(arrays, IGNORE_EOS, "b")
    params.ignore_eos = bool(ignore_eos)

    params.logprobs = _top_k_count(arrays, LOGPROBS, limits)
    params.logprob_token_ids = _explicit_ids(arrays, LOGPROB_TOKEN_IDS, limits)
    params.prompt_logprobs = _top_k_count(arrays, PROMPT_LOGPROBS, limits)
    params.prompt_logprob_token_ids = _explicit_ids(arrays, PROMPT_LOGPROB_TOKEN_IDS, limits)
    _parse_logits_processing(arrays, params, limits)
    params.structured_output = _structured_output(arrays)
    return params


def _stop_strings(arrays: Mapping[str, np.ndarray]) -> list[str]:
    stops = [s for s in _strings(arrays, STOP) if s]
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidInputError(STOP, f"holds {len(stops)} strings, at most {MAX_STOP_STRINGS}")
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_STRING_CHARS:
        raise InvalidInputError(
            STOP,
            f"a string has {len(longest)} characters, at most {MAX_STOP_STRING_CHARS}",
        )
    return stops


def _structured_output(arrays: Mapping[str, np.ndarray]) -> StructuredOutput | None:
    """Its shape only: whether the spec compiles is known later (backend.grammar)."""
    texts = _strings(arrays, STRUCTURED_OUTPUT)
    if not texts:
        return None
    if len(texts) != 1:
        raise InvalidInputError(STRUCTURED_OUTPUT, f"holds {len(texts)} specs, one is allowed")
    if len(texts[0]) > MAX_STRUCTURED_OUTPUT_CHARS:
        raise InvalidInputError(
            STRUCTURED_OUTPUT,
            f"the spec has {len(texts[0])} characters, at most {MAX_STRUCTURED_OUTPUT_CHARS}",
        )
    try:
        return StructuredOutput.from_json(texts[0])
    except ValueError as exc:
        raise InvalidInputError(STRUCTURED_OUTPUT, str(exc)) from None


def _top_k_count(arrays: Mapping[str, np.ndarray], name: str, limits: EngineLimits) -> int | None:
    count = _scalar(arrays, name, "iu")
    if count is not None and not 0 <= count <= limits.max_logprobs:
        raise InvalidInputError(name, f"must be in [0, {limits.max_logprobs}], got {count}")
    return count


def _explicit_ids(arrays: Mapping[str, np.ndarray], name: str, limits: EngineLimits) -> list[int]:
    ids = _int_list(arrays, name)
    if ids is None:
        return []
    if not ids:
        raise InvalidInputError(name, "must not be empty")
    if len(ids) > limits.max_logprob_token_ids:
        raise InvalidInputError(
            name, f"{len(ids)} ids requested, at most {limits.max_logprob_token_ids} are allowed"
        )
    _check_ids(name, ids, limits.vocab_size)
    return ids


def _bounded(arrays: Mapping[str, np.ndarray], name: str, low: float, high: float) -> float | None:
    value = _scalar(arrays, name, "f")
    if value is not None and not low <= value <= high:
        raise InvalidInputError(name, f"must be in [{low:g}, {high:g}], got {value:g}")
    return value


def _parse_logits_processing(
    arrays: Mapping[str, np.ndarray], params: GenerationParams, limits: EngineLimits
) -> None:
    """Penalties, bias, allowed ids and min tokens: they change sampling, never logprobs."""
    params.presence_penalty = _bounded(arrays, PRESENCE_PENALTY, -2.0, 2.0) or 0.0
    params.frequency_penalty = _bounded(arrays, FREQUENCY_PENALTY, -2.0, 2.0) or 0.0
    repetition = _scalar(arrays, REPETITION_PENALTY, "f")
    if repetition is not None:
        if not 0.0 < repetition < float("inf"):
            raise InvalidInputError(REPETITION_PENALTY, f"must be > 0, got {repetition:g}")
        params.repetition_penalty = repetition
    bias_ids = _int_list(arrays, LOGIT_BIAS_IDS) or []
    bias_array = arrays.get(LOGIT_BIAS_VALUES)
    bias_values = [] if bias_array is None else np.asarray(bias_array).reshape(-1).tolist()
    if len(bias_ids) != len(bias_values):
        raise InvalidInputError(
            LOGIT_BIAS_VALUES, f"has {len(bias_values)} values for {len(bias_ids)} ids"
        )
    _check_ids(LOGIT_BIAS_IDS, bias_ids, limits.vocab_size)
    if any(not -100.0 <= v <= 100.0 for v in bias_values):
        raise InvalidInputError(LOGIT_BIAS_VALUES, "each bias must be in [-100, 100]")
    params.logit_bias = dict(zip(bias_ids, bias_values, strict=True))
    allowed = _int_list(arrays, ALLOWED_TOKEN_IDS)
    if allowed is not None:
        if not allowed:
            raise InvalidInputError(ALLOWED_TOKEN_IDS, "must not be empty")
        _check_ids(ALLOWED_TOKEN_IDS, allowed, limits.vocab_size)
        params.allowed_token_ids = allowed
    min_tokens = _scalar(arrays, MIN_TOKENS, "iu")
    if min_tokens is not None:
        room = limits.max_model_len - len(params.prompt_ids)
        # vLLM's min_tokens <= max_tokens, its max_tokens cut to the room. The room first: a
        # chat without a limit has MAX_TOKENS set by the adapter, not by its client.
        if min_tokens > room:
            raise InvalidInputError(
                MIN_TOKENS,
                f"must be at most the {room} tokens that this model's maximum context length of "
                f"{limits.max_model_len} tokens leaves after the prompt's {len(params.prompt_ids)}"
                f", got {min_tokens}",
            )
        if not 0 <= min_tokens <= params.max_tokens:
            raise InvalidInputError(
                MIN_TOKENS, f"must be in [0, MAX_TOKENS={params.max_tokens}], got {min_tokens}"
            )
        params.min_tokens = min_tokens
    params.include_stop_str_in_output = bool(_scalar(arrays, INCLUDE_STOP_STR_IN_OUTPUT, "b"))


def _bytes_array(values: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array.reshape(shape)


def _logprob_array(values: np.ndarray) -> np.ndarray:
    return np.maximum(np.asarray(values, dtype=np.float32), np.float32(NEG_INF_LOGPROB))


def output_arrays(
    out: StepOutput, params: GenerationParams, names: Collection[str] | None = None
) -> dict[str, np.ndarray]:
    """One streamed response of n = len(out.token_ids) tokens: the outputs in `names` (the
    request's requested outputs), or every one when None. Each is present even when empty
    (zero-size): an ensemble only forwards a response once each of its outputs has a tensor.
    Only the named ones are built, since building them holds the GIL."""
    n = len(out.token_ids)
    k = params.logprobs or 0
    m = len(params.logprob_token_ids)
    want = params.logprobs is not None
    builders: dict[str, Callable[[], np.ndarray]] = {
        OUTPUT_IDS: lambda: np.asarray(out.token_ids, dtype=np.int32),
        TEXT_OUTPUT: lambda: _bytes_array([out.text.encode("utf-8")], (1,)),
        OUTPUT_TOKEN_BYTES: lambda: _bytes_array(out.token_bytes, (n,)),
        OUTPUT_LOGPROBS: lambda: _logprob_array(out.logprobs if want else np.zeros(0)),
        TOP_LOGPROB_IDS: lambda: np.asarray(out.top_ids, dtype=np.int32).reshape(n, k),
        TOP_LOGPROBS: lambda: _logprob_array(out.top_logprobs).reshape(n, k),
        TOP_LOGPROB_TOKEN_BYTES: lambda: _bytes_array(out.top_bytes, (n, k)),
        LOGPROB_TOKEN_LOGPROBS: lambda: _logprob_array(out.token_id_logprobs).reshape(n, m),
        LOGPROB_TOKEN_BYTES: lambda: _bytes_array(out.token_id_bytes, (len(out.token_id_bytes),)),
        FINISH_REASON: lambda: _bytes_array([(out.finish_reason or "").encode()], (1,)),
        STOP_REASON: lambda: _bytes_array([_stop_reason_json(out)], (1,)),
        PROMPT_TOKENS: lambda: np.asarray([out.prompt_tokens], dtype=np.int32),
        COMPLETION_TOKENS: lambda: np.asarray([out.completion_tokens], dtype=np.int32),
    }
    wanted = {*builders, *PROMPT_OUTPUTS} if names is None else set(names)
    arrays = {name: builders[name]() for name in builders if name in wanted}
    if not wanted.isdisjoint(PROMPT_OUTPUTS):
        prompt = _prompt_arrays(out.prompt, params)
        arrays.update((name, array) for name, array in prompt.items() if name in wanted)
    return arrays


def _stop_reason_json(out: StepOutput) -> bytes:
    """STOP_REASON: "" until the final response, then its stop reason as JSON."""
    return b"" if out.finish_reason is None else json.dumps(out.stop_reason).encode()


def _prompt_arrays(
    prompt: PromptLogprobs | None, params: GenerationParams
) -> dict[str, np.ndarray]:
    k = params.prompt_logprobs or 0
    m = len(params.prompt_logprob_token_ids)
    if prompt is None:
        return {
            PROMPT_IDS: np.zeros(0, np.int32),
            PROMPT_TOKEN_BYTES: _bytes_array([], (0,)),
            PROMPT_TOKEN_LOGPROBS: np.zeros(0, np.float32),
            PROMPT_TOP_LOGPROB_IDS: np.zeros((0, k), np.int32),
            PROMPT_TOP_LOGPROBS: np.zeros((0, k), np.float32),
            PROMPT_TOP_LOGPROB_TOKEN_BYTES: _bytes_array([], (0, k)),
            PROMPT_LOGPROB_TOKEN_LOGPROBS: np.zeros((0, m), np.float32),
            PROMPT_LOGPROB_TOKEN_BYTES: _bytes_array([], (0,)),
        }
    n = len(prompt.ids) - 1
    return {
        PROMPT_IDS: np.asarray(prompt.ids, dtype=np.int32),
        PROMPT_TOKEN_BYTES: _bytes_array(prompt.token_bytes, (n + 1,)),
        PROMPT_TOKEN_LOGPROBS: _logprob_array(prompt.logprobs).reshape(n),
        PROMPT_TOP_LOGPROB_IDS: np.asarray(prompt.top_ids, dtype=np.int32).reshape(n, k),
        PROMPT_TOP_LOGPROBS: _logprob_array(prompt.top_logprobs).reshape(n, k),
        PROMPT_TOP_LOGPROB_TOKEN_BYTES: _bytes_array(prompt.top_bytes, (n, k)),
        PROMPT_LOGPROB_TOKEN_LOGPROBS: _logprob_array(prompt.token_id_logprobs).reshape(n, m),
        PROMPT_LOGPROB_TOKEN_BYTES: _bytes_array(prompt.token_id_bytes, (m,)),
    }
