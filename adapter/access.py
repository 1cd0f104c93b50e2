"""Which paths need the API key, which count as work (concurrency slot, deadline), and the
bearer-key check."""

from __future__ import annotations

import enum
import hmac

from pydantic import SecretStr
from starlette.datastructures import Headers

from adapter.errors import AuthenticationError

WORK_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/generative_scoring"}
)
"""Requests that call Triton: they take a concurrency slot and have a deadline."""
_PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize", "/generative_scoring"})
METRICS_PATH = "/metrics"
LIVENESS_PATH = "/health"
KNOWN_PATHS = WORK_PATHS | {"/v1/models", LIVENESS_PATH, "/health/ready", METRICS_PATH}
"""Paths (without parameters) that are their own metric label."""


class PathKind(enum.Enum):
    """How the middleware treats a path."""

    API = "api"
    """/v1/* and vLLM's extra routes: the API key when one is set."""
    METRICS = "metrics"
    """/metrics: the metrics key when one is set; answers while draining."""
    LIVENESS = "liveness"
    """/health: always open, answers while draining (the process is alive)."""
    OPEN = "open"
    """/health/ready, /docs, /openapi.json, unknown paths: open; 503 while draining."""


def path_kind(path: str) -> PathKind:
    if path == "/v1" or path.startswith("/v1/") or path in _PROTECTED_PATHS:
        return PathKind.API
    if path == METRICS_PATH:
        return PathKind.METRICS
    if path == LIVENESS_PATH:
        return PathKind.LIVENESS
    return PathKind.OPEN


def check_bearer(headers: Headers, key: SecretStr, *, what: str) -> None:
    """Raises `AuthenticationError` unless `Authorization: Bearer <key>` carries `key`.

    Compared with `hmac.compare_digest`, whose time does not depend on where the two differ.
    """
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError(
            f"{what} needs an API key: send it as `Authorization: Bearer <key>`."
        )
    if not hmac.compare_digest(token.strip().encode(), key.get_secret_value().encode()):
        raise AuthenticationError("Incorrect API key provided.")
