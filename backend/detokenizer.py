"""Incremental, per-request detokenization from token bytes.

Text is decoded from the concatenated bytes of the generated tokens with an incremental UTF-8
decoder: a character split across tokens is held back until its last byte arrives (never emitted
as U+FFFD), and joined deltas equal the decode of all bytes at once. Bytes that can never form a
character become U+FFFD, as `bytes.decode(errors="replace")` does.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class IncrementalDetokenizer:
    def __init__(self, token_bytes: Sequence[bytes], skip_ids: frozenset[int]) -> None:
        self._token_bytes = token_bytes
        self._skip_ids = skip_ids
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The new text that `token_id` completes (possibly empty)."""
        if token_id in self._skip_ids:
            return ""
        return self._decoder.decode(self._token_bytes[token_id])

    def flush(self) -> str:
        """Whatever is still held back, at the end of generation."""
        return self._decoder.decode(b"", final=True)
