"""OpenAI error objects, the exceptions behind them, and the HTTP status of each."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from pydantic import BaseModel


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (HTTP 400); `parameter` names the field."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.parameter = parameter
        self.value = value


class ModelNotFoundError(LookupError):
    """The request names a model this adapter does not serve (HTTP 404)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")
        self.model = model


class EngineUnavailableError(RuntimeError):
    """Triton cannot be reached or the model is not ready (HTTP 503)."""


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


def error_response(exc: BaseException) -> tuple[HTTPStatus, ErrorResponse]:
    """The status and OpenAI error body for any exception that reaches a route or a stream."""
    if isinstance(exc, InvalidRequestError):
        status = HTTPStatus.BAD_REQUEST
        info = ErrorInfo(message=exc.message, type="invalid_request_error", param=exc.parameter)
    elif isinstance(exc, ModelNotFoundError):
        status = HTTPStatus.NOT_FOUND
        info = ErrorInfo(
            message=str(exc), type="invalid_request_error", param="model", code="model_not_found"
        )
    elif isinstance(exc, EngineUnavailableError):
        status = HTTPStatus.SERVICE_UNAVAILABLE
        info = ErrorInfo(message=str(exc), type="server_error", code="service_unavailable")
    else:
        status = HTTPStatus.INTERNAL_SERVER_ERROR
        info = ErrorInfo(message=str(exc) or type(exc).__name__, type="server_error")
    return status, ErrorResponse(error=info)
