"""Validated generation parameters of one request, and the limits they are checked against."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.contract import DEFAULT_MAX_LOGPROB_TOKEN_IDS, DEFAULT_MAX_LOGPROBS
from backend.structured_output import StructuredOutput


class InvalidInputError(ValueError):
    """A request the engine refuses; `parameter` names the offending tensor."""

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(f"{parameter}: {message}")
        self.parameter = parameter
        self.detail = message


@dataclass(frozen=True)
class EngineLimits:
    """Server-side bounds, from the `llm` model's config.pbtxt parameters."""

    vocab_size: int
    max_model_len: int
    """Prompt plus generated tokens; a prompt must leave room for at least one token."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    """Largest natural top-k (`LOGPROBS`)."""
    max_logprob_token_ids: int = DEFAULT_MAX_LOGPROB_TOKEN_IDS
    """Most explicit ids (`LOGPROB_TOKEN_IDS`) per request."""
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    """`GenerationParams` fields the model's generation_config.json sets (temperature, top_p,
    top_k, min_p, repetition_penalty): a request's value for one that it leaves out, as vLLM
    serves them (`backend.model_runner.sampling_defaults`)."""
    max_new_tokens: int | None = None
    """generation_config.json's `max_new_tokens`: the most tokens any request generates, as
    vLLM caps `max_tokens` with it."""


@dataclass
class GenerationParams:
    """What one request asks for. Defaults are those of the OpenAI completions API."""

    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k filtering."""
    min_p: float = 0.0
    """vLLM's: after temperature, ids less probable than min_p x the most probable one's are
    dropped; 0 disables it."""
    seed: int | None = None
    """Same seed, same tokens; None draws a random seed."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends before them, and they are not returned."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """Natural top-k count; not None also returns the sampled token's logprob."""
    logprob_token_ids: list[int] = field(default_factory=list)
    """Explicit ids whose logprobs are returned at every generated position, in this order."""
    prompt_logprobs: int | None = None
    """Top-k count at prompt positions; not None also returns each prompt token's logprob."""
    prompt_logprob_token_ids: list[int] = field(default_factory=list)
    """Explicit ids whose logprobs are returned at every prompt position (from the second on)."""
    presence_penalty: float = 0.0
    """OpenAI: subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """OpenAI: subtracted per occurrence from the logit of every generated token."""
    repetition_penalty: float = 1.0
    """vLLM/HF: logits of tokens in the prompt or output divided (> 0) or multiplied (< 0) by it."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the logits of these ids before sampling."""
    allowed_token_ids: list[int] = field(default_factory=list)
    """When not empty, only these ids can be sampled."""
    min_tokens: int = 0
    """EOS and stop ids cannot be sampled before this many tokens were generated."""
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = None
    """The shape the output must take; the request ends with `stop` once it is complete."""
    request_id: str = ""

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or bool(self.logprob_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None or bool(self.prompt_logprob_token_ids)

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )
