"""The `parameters` of a model's config.pbtxt, typed, with the defaults documented there."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_type_hints

from backend.contract import (
    DEFAULT_MAX_LOGPROB_TOKEN_IDS,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MAX_QUEUE_SIZE,
    MAX_TOP_K,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""`auto` is bfloat16 on CUDA and float32 on CPU (`backend.model_runner.resolve_dtype`)."""
RESTARTS_ENV = "LLM_SERVER_RESTARTS"
"""How often the launcher has restarted tritonserver after a fault; the `llm` model reports it
(`llm_server_restarts_total`), since Triton's own counters start again at 0 with the server."""


def _parameters(model_config: dict[str, Any]) -> dict[str, str]:
    return {
        key: value.get("string_value", "")
        for key, value in (model_config.get("parameters") or {}).items()
    }


def _integer(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        message = f"config.pbtxt parameter `{name}` must be an integer, got {value!r}"
        raise ValueError(message) from None


def _boolean(value: str, name: str) -> bool:
    lowered = value.strip().lower()
    if lowered not in ("true", "false", "1", "0"):
        raise ValueError(f"config.pbtxt parameter `{name}` must be true or false, got {value!r}")
    return lowered in ("true", "1")


def resolve_model_path(value: str, model_repository: str) -> str:
    """A relative `model_path` is relative to the model repository folder (the parent of the
    model's own folder), so a repository can ship a pointer to a model beside it."""
    path = Path(value)
    if not path.is_absolute():
        path = (Path(model_repository).parent / path).resolve()
    return str(path)


@dataclass(frozen=True)
class LLMConfig:
    model_path: str
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int = 0
    """0 = the model's max_position_embeddings."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    num_threads: int = 0
    """torch intra-op threads; 0 = half the CPU cores (the rest serve Triton and its clients)."""
    kv_cache_memory_mb: int = 0
    """KV cache budget; 0 = room for `max_num_seqs` sequences of `max_model_len` tokens."""
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE
    """Requests waiting for a slot beyond which new ones get a "server busy" error."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_logprob_token_ids: int = DEFAULT_MAX_LOGPROB_TOKEN_IDS
    max_tokens_per_response: int = 0
    """Most tokens one streamed response carries when the engine runs ahead; 0 = no cap."""
    stream_interval_ms: int = 20
    """While several requests stream, the least time between two responses of one request
    (its first and last tokens go at once; a lone stream never waits); 0 = no waiting."""
    stream_interval_tokens: int = 3
    """While several requests stream, the fewest tokens a response of one request carries
    besides its first and last (so the interval follows the step time); 1 = no floor."""
    grammar_cache_size: int = 64
    """Compiled structured-output grammars kept (least recently used ones go first)."""
    grammar_compile_timeout_ms: int = 10000
    """A request whose structured output takes longer to compile gets INVALID_ARG."""
    grammar_disable_any_whitespace: bool = False
    """JSON kinds allow no free whitespace for every request (as vLLM's server option), not
    only for those that ask: a small model may otherwise never end the object."""
    fast_decode: bool = True
    """Decode Llama-family models through `backend.fast_decode` (same math, less Python)."""
    engine_hang_timeout_s: int = 300
    """An engine process that sends nothing for this long is hung (it reports every iteration,
    and every 50 ms when idle, so only one forward that long, or a deadlock, stays silent): the
    stub kills it, and its requests fail as at its death; 0 = never."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_logprobs <= MAX_TOP_K:
            raise ValueError(f"max_logprobs must be in [0, {MAX_TOP_K}], got {self.max_logprobs}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in (
            "max_model_len",
            "num_threads",
            "kv_cache_memory_mb",
            "max_logprob_token_ids",
            "max_tokens_per_response",
            "stream_interval_ms",
            "engine_hang_timeout_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "max_num_seqs",
            "max_queue_size",
            "stream_interval_tokens",
            "grammar_cache_size",
            "grammar_compile_timeout_ms",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_model_config(cls, model_config: dict[str, Any], model_repository: str) -> LLMConfig:
        """`model_repository` is Triton's `args["model_repository"]` (the model's own folder)."""
        return cls.from_parameters(_parameters(model_config), model_repository)

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], model_repository: str) -> LLMConfig:
        """The config of these parameter values; ValueError naming the first bad one (the
        launcher checks them so before tritonserver starts)."""
        if not params.get("model_path"):
            raise ValueError("config.pbtxt parameter `model_path` is required")
        values: dict[str, Any] = {}
        types = get_type_hints(cls)
        for field in fields(cls):
            raw = params.get(field.name, "").strip()
            if field.name == "model_path" or not raw:  # empty = the default
                continue
            if types[field.name] is bool:
                values[field.name] = _boolean(raw, field.name)
            elif types[field.name] is int:
                values[field.name] = _integer(raw, field.name)
            else:
                values[field.name] = raw
        return cls(model_path=resolve_model_path(params["model_path"], model_repository), **values)


@dataclass(frozen=True)
class PreprocessingConfig:
    """`preprocessing`'s parameters."""

    model_path: str
    max_model_len: int = 0
    """The context `llm` serves (the launcher writes the same value into both), which bounds a
    prompt's text before it is tokenized; 0 = the model's own."""

    @classmethod
    def from_model_config(
        cls, model_config: dict[str, Any], model_repository: str
    ) -> PreprocessingConfig:
        params = _parameters(model_config)
        if not params.get("model_path"):
            raise ValueError("config.pbtxt parameter `model_path` is required")
        max_model_len = _integer(params.get("max_model_len", "").strip() or "0", "max_model_len")
        if max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {max_model_len}")
        return cls(resolve_model_path(params["model_path"], model_repository), max_model_len)
