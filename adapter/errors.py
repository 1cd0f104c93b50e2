"""OpenAI error objects, the exceptions behind them, and the HTTP status of each."""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

RETRY_AFTER_S = 1
"""What a 503 of an unavailable Triton tells the client to wait (the openai SDK honours it)."""


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (HTTP 400); `parameter` names the field."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.parameter = parameter
        self.value = value


class AuthenticationError(Exception):
    """No `Authorization: Bearer <key>` header, or the wrong key (HTTP 401)."""

    headers: Mapping[str, str] = {"WWW-Authenticate": "Bearer"}


class ModelNotFoundError(LookupError):
    """The request names a model this adapter does not serve (HTTP 404)."""

    parameter = "model"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")
        self.model = model


class RequestTooLargeError(Exception):
    """The request body is larger than `max_request_body_bytes` (HTTP 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than {limit} bytes.")


class TooManyRequestsError(Exception):
    """Every concurrency slot is busy and the wait queue is full (HTTP 429, `Retry-After`)."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.headers: Mapping[str, str] = {"Retry-After": str(retry_after_s)}


class ServiceUnavailableError(RuntimeError):
    """The server cannot take the request now (HTTP 503); another try may succeed."""


class EngineUnavailableError(ServiceUnavailableError):
    """Triton cannot be reached, the model is not ready, its queue is full or its engine died
    (HTTP 503). Each passes: the launcher restarts a faulty Triton within seconds
    (docs/design.md, "Surviving the engine's death"), so the client is told to try again
    (`Retry-After`)."""

    headers: Mapping[str, str] = {"Retry-After": str(RETRY_AFTER_S)}


class ShuttingDownError(ServiceUnavailableError):
    """The adapter is draining after SIGTERM (HTTP 503); the client should go to another
    replica, so the connection is closed after the response."""

    headers: Mapping[str, str] = {"Connection": "close"}

    def __init__(self) -> None:
        super().__init__("The server is shutting down.")


class RequestTimeoutError(Exception):
    """The request ran longer than `request_timeout_s` (HTTP 504); its Triton requests are
    cancelled."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"The request did not finish within {timeout_s:g} s.")


class EngineError(RuntimeError):
    """Triton or the model failed in a way the request did not cause (HTTP 500)."""


class TritonInputError(Exception):
    """The model rejected one input tensor (INVALID_ARG); serving maps it to a request field."""

    def __init__(self, tensor: str, detail: str) -> None:
        super().__init__(f"{tensor}: {detail}")
        self.tensor = tensor
        self.detail = detail


class ErrorInfo(BaseModel):
    """The `error` object of the OpenAI API."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """`{"error": {...}}`, the body of every non-2xx response and of a stream's error event."""

    error: ErrorInfo


# (exception, status, OpenAI `type`, `code`), the first match wins. OpenAI's 429 for a request
# rate has type "requests" (https://platform.openai.com/docs/guides/error-codes).
_KINDS: tuple[tuple[type[Exception], HTTPStatus, str, str | None], ...] = (
    (InvalidRequestError, HTTPStatus.BAD_REQUEST, "invalid_request_error", None),
    (AuthenticationError, HTTPStatus.UNAUTHORIZED, "invalid_request_error", "invalid_api_key"),
    (ModelNotFoundError, HTTPStatus.NOT_FOUND, "invalid_request_error", "model_not_found"),
    (
        RequestTooLargeError,
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        "invalid_request_error",
        "request_too_large",
    ),
    (TooManyRequestsError, HTTPStatus.TOO_MANY_REQUESTS, "requests", "rate_limit_exceeded"),
    (
        ServiceUnavailableError,
        HTTPStatus.SERVICE_UNAVAILABLE,
        "server_error",
        "service_unavailable",
    ),
    (RequestTimeoutError, HTTPStatus.GATEWAY_TIMEOUT, "server_error", "timeout"),
)


EXPECTED_ERRORS: tuple[type[Exception], ...] = (*(kind[0] for kind in _KINDS), EngineError)
"""The exceptions that are answered as errors of the request, not as bugs."""


def error_response(exc: BaseException) -> tuple[HTTPStatus, ErrorResponse]:
    """The status and OpenAI error body for any exception that reaches a route or a stream."""
    status, kind, code = HTTPStatus.INTERNAL_SERVER_ERROR, "server_error", None
    for cls, status_of, kind_of, code_of in _KINDS:
        if isinstance(exc, cls):
            status, kind, code = status_of, kind_of, code_of
            break
    parameter = exc.parameter if isinstance(exc, InvalidRequestError | ModelNotFoundError) else None
    info = ErrorInfo(message=str(exc) or type(exc).__name__, type=kind, param=parameter, code=code)
    return status, ErrorResponse(error=info)


def error_headers(exc: BaseException) -> dict[str, str]:
    """Headers an error response carries (`Retry-After`, `WWW-Authenticate`, ...)."""
    return dict(getattr(exc, "headers", None) or {})


_ERROR_DESCRIPTIONS = {
    400: "Invalid request (validation included: never 422)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    413: "Request body too large",
    429: "Concurrency limit and wait queue full (`Retry-After`)",
    500: "Server error",
    503: "Triton not ready, engine queue full, or the adapter shutting down",
    504: "Request timeout",
}
WORK_ERROR_STATUSES = tuple(_ERROR_DESCRIPTIONS)
"""What a request that calls Triton (`access.WORK_PATHS`) may answer besides 200."""


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of a route that may answer these statuses with an error object."""
    return {
        status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
        for status in statuses
    }
