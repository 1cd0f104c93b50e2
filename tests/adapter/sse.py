"""Parsing of the adapter's SSE bodies in unit tests."""

from __future__ import annotations

import json
from typing import Any


def sse_payloads(body: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded except the final "[DONE]"."""
    events = [e for e in body.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), body
    data = [e[len("data: ") :] for e in events]
    assert data[-1] == "[DONE]", "a stream always ends with [DONE]"
    return [json.loads(d) for d in data[:-1]] + ["[DONE]"]
