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
from adapter.tensors import TritonOutput


@dataclass(frozen=True)
class TokenLogprob:
    """One token's id, raw bytes and logprob (raw log-softmax; -inf arrives as -9999.0)."""

    token_id: int
    token_bytes: bytes
    logprob: float

    def text(self, as_token_ids: bool) -> str:
        if as_token_ids:
            return f"token_id:{self.token_id}"
        return self.token_bytes.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class PositionLogprobs:
    """One generated position: the sampled token and what goes into its `top_logprobs`."""

    sampled: TokenLogprob
    alternatives: tuple[TokenLogprob, ...]
    """With explicit ids: the sampled token, then each requested id other than it, in request
    order. Otherwise the natural top-k in rank order."""
    explicit: bool


class LogprobsCollector:
    """Turns each response of one request into positions.

    Stateful because LOGPROB_TOKEN_BYTES (the requested ids' bytes) comes on the first
    response only.
    """

    def __init__(self, logprob_token_ids: Sequence[int]) -> None:
        self._ids = tuple(logprob_token_ids)
        self._id_bytes: tuple[bytes, ...] | None = None

    def positions(self, output: TritonOutput) -> list[PositionLogprobs]:
        n = len(output.output_ids)
        if len(output.logprobs) != n or len(output.token_bytes) != n:
            raise EngineError(
                f"Triton response has {n} tokens but {len(output.logprobs)} logprobs and "
                f"{len(output.token_bytes)} token bytes"
            )
        if self._ids and self._id_bytes is None:
            if len(output.requested_token_bytes) != len(self._ids):
                raise EngineError(
                    f"first Triton response has {len(output.requested_token_bytes)} bytes for "
                    f"{len(self._ids)} logprob_token_ids"
                )
            self._id_bytes = tuple(output.requested_token_bytes)
        table = output.requested_logprobs if self._ids else output.top_logprobs
        if len(table) != n:
            raise EngineError(f"Triton response has {n} tokens but {len(table)} logprob rows")
        positions = []
        for i, (token_id, token_bytes, logprob) in enumerate(
            zip(output.output_ids, output.token_bytes, output.logprobs, strict=True)
        ):
            sampled = TokenLogprob(token_id, token_bytes, logprob)
            if self._ids:
                alternatives = (sampled, *self._requested(output.requested_logprobs[i], token_id))
            else:
                alternatives = tuple(
                    TokenLogprob(*entry)
                    for entry in zip(
                        output.top_ids[i],
                        output.top_token_bytes[i],
                        output.top_logprobs[i],
                        strict=True,
                    )
                )
            positions.append(PositionLogprobs(sampled, alternatives, explicit=bool(self._ids)))
        return positions

    def _requested(self, row: Sequence[float], sampled_id: int) -> list[TokenLogprob]:
        if len(row) != len(self._ids):
            raise EngineError(f"Triton sent {len(row)} logprobs for {len(self._ids)} ids")
        return [
            TokenLogprob(token_id, token_bytes, logprob)
            for token_id, token_bytes, logprob in zip(
                self._ids, self._id_bytes or (), row, strict=True
            )
            if token_id != sampled_id
        ]
