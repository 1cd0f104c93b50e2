"""What the engine hands out per request: `StepOutput`s of one or more tokens, how several of
them merge into one response (docs/design.md, "Streaming responses"), and the kinds of error it
ends with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Kinds of final error a request can end with (model.py maps them to Triton error codes).
INTERNAL = "internal"
CANCELLED = "cancelled"
BUSY = "busy"
INVALID = "invalid"
"""Input found bad only once the engine worked on it (a grammar that does not compile)."""


@dataclass(frozen=True)
class FinalError:
    """The end of a request as an error of `kind` (one of the kinds above), in place of its last
    output."""

    message: str
    kind: str


@dataclass
class PromptLogprobs:
    """Logprobs at prompt positions 1..P-1 (position i scores prompt token i), sent once."""

    ids: list[int]
    token_bytes: list[bytes]
    logprobs: np.ndarray  # [P-1]
    top_ids: np.ndarray  # [P-1, k]
    top_logprobs: np.ndarray  # [P-1, k]
    top_bytes: list[bytes]  # (P-1) * k
    token_id_logprobs: np.ndarray  # [P-1, M]
    token_id_bytes: list[bytes]  # [M]


@dataclass
class StepOutput:
    """The tokens of one response (n >= 0 of them, one per engine step), and the finish on
    the last."""

    token_ids: list[int]
    text: str
    token_bytes: list[bytes]
    logprobs: np.ndarray  # [n]
    top_ids: np.ndarray  # [n, k]
    top_logprobs: np.ndarray  # [n, k]
    top_bytes: list[bytes]  # n * k, row-major
    token_id_logprobs: np.ndarray  # [n, M]
    token_id_bytes: list[bytes]  # [M] on the first response, empty afterwards
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    """Cumulative: the request's tokens up to this output's last."""
    prompt: PromptLogprobs | None = None
    """On the first response, when prompt logprobs were asked for."""
    stop_reason: str | int | None = None
    """With finish_reason "stop": the stop string or stop token id that ended the request, None
    for the tokenizer's EOS or a completed structured output (vLLM's `stop_reason`)."""


def merge_outputs(outputs: Sequence[StepOutput]) -> StepOutput:
    """Consecutive outputs of one request as one: tokens, text and rows joined in order, the
    first's once-only fields (requested ids' bytes, prompt logprobs), the last's finish."""
    if len(outputs) == 1:
        return outputs[0]
    first, last = outputs[0], outputs[-1]
    return StepOutput(
        token_ids=[token for out in outputs for token in out.token_ids],
        text="".join(out.text for out in outputs),
        token_bytes=[piece for out in outputs for piece in out.token_bytes],
        logprobs=np.concatenate([out.logprobs for out in outputs]),
        top_ids=np.concatenate([out.top_ids for out in outputs]),
        top_logprobs=np.concatenate([out.top_logprobs for out in outputs]),
        top_bytes=[piece for out in outputs for piece in out.top_bytes],
        token_id_logprobs=np.concatenate([out.token_id_logprobs for out in outputs]),
        token_id_bytes=first.token_id_bytes,
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        prompt=first.prompt,
        stop_reason=last.stop_reason,
    )
