"""Per-position logprobs from Triton responses, shared by both endpoints' formatting.

Token strings: with `return_tokens_as_token_ids` a token is `"token_id:N"` (vLLM). Otherwise it
is the token's raw bytes decoded as UTF-8 with errors="replace", so a token holding part of a
multi-byte character reads as U+FFFD (what vLLM's single-token decode gives); chat's `bytes`
always carry the real bytes, from which clients rebuild such characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from adapter.errors import EngineError
from adapter.tensors import LogprobRows, PromptOutput, TritonOutput


@dataclass(frozen=True)
class TokenLogprob:
    """One token's id, raw bytes and logprob (raw log-softmax; -inf arrives as -9999.0)."""

    token_id: int
    token_bytes: bytes
    logprob: float

    def text(self, as_token_ids: bool) -> str:
        return token_text(self.token_id, self.token_bytes, as_token_ids)


def token_text(token_id: int, token_bytes: bytes, as_token_ids: bool) -> str:
    """A token as the API shows it (see the module docstring)."""
    if as_token_ids:
        return f"token_id:{token_id}"
    return token_bytes.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class PositionLogprobs:
    """One position: its token (sampled, or the prompt's) and what goes into `top_logprobs`."""

    sampled: TokenLogprob
    alternatives: tuple[TokenLogprob, ...]
    """With explicit ids: the position's token, then each requested id other than it, in
    request order. Otherwise the natural top-k in rank order."""
    explicit: bool


class LogprobsCollector:
    """Turns each response of one request into positions, generated and prompt ones.

    Stateful because LOGPROB_TOKEN_BYTES (the requested ids' bytes) comes on the first
    response only; PROMPT_LOGPROB_TOKEN_BYTES comes with the prompt's rows.
    """

    def __init__(
        self, logprob_token_ids: Sequence[int], prompt_logprob_token_ids: Sequence[int] = ()
    ) -> None:
        self._ids = tuple(logprob_token_ids)
        self._id_bytes: tuple[bytes, ...] | None = None
        self._prompt_ids = tuple(prompt_logprob_token_ids)

    def positions(self, output: TritonOutput) -> list[PositionLogprobs]:
        """The generated positions of one response."""
        if self._ids and self._id_bytes is None:
            self._id_bytes = _id_bytes(self._ids, output.requested_token_bytes, "logprob")
        explicit = tuple(zip(self._ids, self._id_bytes or (), strict=True))
        return _positions(output.output_ids, output.token_bytes, output, explicit)

    def prompt_positions(self, prompt: PromptOutput) -> list[PositionLogprobs]:
        """Prompt tokens 1..P-1, each scored given the tokens before it (token 0 has no row)."""
        id_bytes = _id_bytes(self._prompt_ids, prompt.requested_token_bytes, "prompt_logprob")
        explicit = tuple(zip(self._prompt_ids, id_bytes, strict=True))
        return _positions(prompt.ids[1:], prompt.token_bytes[1:], prompt, explicit)


def _id_bytes(ids: Sequence[int], id_bytes: Sequence[bytes], field: str) -> tuple[bytes, ...]:
    if len(id_bytes) != len(ids):
        raise EngineError(
            f"the Triton response has {len(id_bytes)} bytes for {len(ids)} {field}_token_ids"
        )
    return tuple(id_bytes)


def _positions(
    ids: Sequence[int],
    token_bytes: Sequence[bytes],
    rows: LogprobRows,
    explicit: Sequence[tuple[int, bytes]],
) -> list[PositionLogprobs]:
    """`explicit` (id, bytes) pairs: the requested ids, whose column j is `explicit[j]`."""
    n = len(ids)
    if len(rows.logprobs) != n or len(token_bytes) != n:
        raise EngineError(
            f"Triton response has {n} tokens but {len(rows.logprobs)} logprobs and "
            f"{len(token_bytes)} token bytes"
        )
    table = rows.requested_logprobs if explicit else rows.top_logprobs
    if len(table) != n:
        raise EngineError(f"Triton response has {n} tokens but {len(table)} logprob rows")
    positions = []
    for i, sampled in enumerate(map(TokenLogprob, ids, token_bytes, rows.logprobs)):
        if explicit:
            row = rows.requested_logprobs[i]
            if len(row) != len(explicit):
                raise EngineError(f"Triton sent {len(row)} logprobs for {len(explicit)} ids")
            alternatives = (
                sampled,
                *(
                    TokenLogprob(token_id, id_bytes, logprob)
                    for (token_id, id_bytes), logprob in zip(explicit, row, strict=True)
                    if token_id != sampled.token_id
                ),
            )
        else:
            alternatives = tuple(
                map(TokenLogprob, rows.top_ids[i], rows.top_token_bytes[i], rows.top_logprobs[i])
            )
        positions.append(PositionLogprobs(sampled, alternatives, explicit=bool(explicit)))
    return positions
