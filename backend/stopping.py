"""Decides when a sequence stops, and why (the OpenAI `finish_reason`)."""

from __future__ import annotations

STOP = "stop"
LENGTH = "length"


class StopStringMatcher:
    """Cuts the text stream at the first stop string to end, emitted only with `include_stop`.

    The last `len(longest stop) - 1` characters are held back, because a stop string may begin
    in them and end in a later delta; any stop string that starts in emitted text has therefore
    already been seen whole.
    """

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        """`include_stop` (vLLM's include_stop_str_in_output) emits the stop string itself."""
        self._stops = stops
        self._include = include_stop
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._buffer = ""

    def push(self, text: str, search: bool = True) -> tuple[str, str | None]:
        """(text that can be emitted now, the stop string found, if any). Only a stop string
        that ends in `text` counts, as in vLLM, which looks at new text only: with `search`
        false (vLLM's `min_tokens` not yet reached) none is looked for, and one that ended
        there is not found later."""
        if not self._stops:
            return text, None
        new_from = len(self._buffer)
        self._buffer += text
        # The one that ends first wins, ties in list order, as if the text came a character at
        # a time (vLLM's `check_stop_strings`).
        hits = [
            (i + len(s), order, i)
            for order, s in enumerate(self._stops)
            if search and (i := self._buffer.find(s, max(0, new_from - len(s) + 1))) >= 0
        ]
        if hits:
            end, order, start = min(hits)
            emit, self._buffer = self._buffer[: end if self._include else start], ""
            return emit, self._stops[order]
        cut = max(len(self._buffer) - self._hold, 0)
        emit, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return emit, None

    def flush(self) -> str:
        emit, self._buffer = self._buffer, ""
        return emit


def token_stop_reason(
    token_id: int,
    *,
    generated: int,
    total_len: int,
    max_tokens: int,
    max_model_len: int,
    stop_ids: frozenset[int],
) -> str | None:
    """The finish reason after appending `token_id`, or None to continue.

    `stop_ids` holds EOS (unless ignored) and the request's stop token ids; `total_len` counts
    prompt and generated tokens.
    """
    if token_id in stop_ids:
        return STOP
    if generated >= max_tokens or total_len >= max_model_len:
        return LENGTH
    return None
