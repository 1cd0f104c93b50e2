"""Per-position logprobs from Triton responses, shared by both endpoints' formatting.

Token strings: with `return_tokens_as_token_ids` a token is `"token_id:N"` (vLLM). Otherwise it
is the token's raw bytes decoded as UTF-8 with errors="replace", so a token holding part of a
multi-byte character reads as U+FFFD (what vLLM's single-token decode gives); chat's `bytes`
always carry the real bytes, from which clients rebuild such characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from adapter.errors import EngineError
from adapter.tensors import LogprobRows, PromptOutput, TritonOutput


class TokenLogprob(NamedTuple):
    """One token's id, raw bytes and logprob (raw log-softmax; -inf arrives as -9999.0).

    A NamedTuple: with 1024 `logprob_token_ids` there are 1024 of them a position, and a
    tuple is built in a fraction of a frozen dataclass's time."""

    token_id: int
    token_bytes: bytes
    logprob: float


def token_text(token_id: int, token_bytes: bytes, as_token_ids: bool) -> str:
    """A token as the API shows it (see the module docstring)."""
    if as_token_ids:
        return f"token_id:{token_id}"
    return token_bytes.decode("utf-8", errors="replace")


class ShownTokens(dict[tuple[int, bytes], tuple[str, list[int]]]):
    """(id, bytes) -> the token's text (`token_text`) and its bytes as a list, formatted once
    per request: with explicit ids the same tokens recur at every position. A dict whose
    misses fill it, so that a hit costs no Python call (docs/design.md, "Logprob entries as
    dicts")."""

    def __init__(self, as_token_ids: bool) -> None:
        super().__init__()
        self._as_token_ids = as_token_ids

    def __missing__(self, key: tuple[int, bytes]) -> tuple[str, list[int]]:
        token_id, token_bytes = key
        shown = self[key] = (token_text(token_id, token_bytes, self._as_token_ids), [*token_bytes])
        return shown


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
        self._columns: _Columns | None = None
        self._prompt_ids = tuple(prompt_logprob_token_ids)

    def positions(self, output: TritonOutput) -> list[PositionLogprobs]:
        """The generated positions of one response."""
        if self._columns is None:
            id_bytes = (
                _id_bytes(self._ids, output.requested_token_bytes, "logprob") if self._ids else ()
            )
            self._columns = _Columns(self._ids, id_bytes)
        return _positions(output.output_ids, output.token_bytes, output, self._columns)

    def prompt_positions(self, prompt: PromptOutput) -> list[PositionLogprobs]:
        """Prompt tokens 1..P-1, each scored given the tokens before it (token 0 has no row)."""
        id_bytes = _id_bytes(self._prompt_ids, prompt.requested_token_bytes, "prompt_logprob")
        columns = _Columns(self._prompt_ids, id_bytes)
        return _positions(prompt.ids[1:], prompt.token_bytes[1:], prompt, columns)


class _Columns:
    """The requested ids (distinct, in request order) and their bytes: column j of a row of
    requested logprobs is `ids[j]`."""

    def __init__(self, ids: tuple[int, ...], id_bytes: tuple[bytes, ...]) -> None:
        self.ids = ids
        self.id_bytes = id_bytes
        self._index = {token_id: j for j, token_id in enumerate(ids)}

    def entries(self, sampled: TokenLogprob, row: list[float]) -> tuple[TokenLogprob, ...]:
        """`sampled` first, then every requested id other than it with its logprob."""
        j = self._index.get(sampled.token_id)
        if j is None:
            return (sampled, *map(TokenLogprob, self.ids, self.id_bytes, row))
        rest = map(
            TokenLogprob,
            self.ids[:j] + self.ids[j + 1 :],
            self.id_bytes[:j] + self.id_bytes[j + 1 :],
            row[:j] + row[j + 1 :],
        )
        return (sampled, *rest)


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
    columns: _Columns,
) -> list[PositionLogprobs]:
    """With requested ids (`columns.ids` not empty) their rows, else the natural top-k."""
    n = len(ids)
    if len(rows.logprobs) != n or len(token_bytes) != n:
        raise EngineError(
            f"Triton response has {n} tokens but {len(rows.logprobs)} logprobs and "
            f"{len(token_bytes)} token bytes"
        )
    explicit = bool(columns.ids)
    table = rows.requested_logprobs if explicit else rows.top_logprobs
    if len(table) != n:
        raise EngineError(f"Triton response has {n} tokens but {len(table)} logprob rows")
    positions = []
    for i, sampled in enumerate(map(TokenLogprob, ids, token_bytes, rows.logprobs)):
        if explicit:
            row = rows.requested_logprobs[i]
            if len(row) != len(columns.ids):
                raise EngineError(f"Triton sent {len(row)} logprobs for {len(columns.ids)} ids")
            alternatives = columns.entries(sampled, row)
        else:
            alternatives = tuple(
                map(TokenLogprob, rows.top_ids[i], rows.top_token_bytes[i], rows.top_logprobs[i])
            )
        positions.append(PositionLogprobs(sampled, alternatives, explicit=explicit))
    return positions
