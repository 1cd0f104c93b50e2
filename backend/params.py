"""Validated generation parameters of one request, and the limits they are checked against."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine refuses; `parameter` names the offending tensor."""

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(f"{parameter}: {message}")
        self.parameter = parameter


@dataclass(frozen=True)
class EngineLimits:
    """Server-side bounds, from the `llm` model's config.pbtxt parameters."""

    vocab_size: int
    max_model_len: int
    """Prompt plus generated tokens; a prompt must leave room for at least one token."""
    max_logprobs: int = 20
    """Largest natural top-k (`LOGPROBS`)."""
    max_logprob_token_ids: int = 1024
    """Most explicit ids (`LOGPROB_TOKEN_IDS`) per request."""


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
    request_id: str = ""

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or bool(self.logprob_token_ids)
