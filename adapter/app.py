"""`create_app`: the FastAPI application, its lifespan state and its error handlers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapter.chat.router import router as chat_router
from adapter.chat.serving import OpenAIServingChat
from adapter.completions.router import router as completions_router
from adapter.completions.serving import OpenAIServingCompletion
from adapter.engine_client import EngineClient
from adapter.errors import (
    EXPECTED_ERRORS,
    WORK_ERROR_STATUSES,
    EngineError,
    EngineUnavailableError,
    ErrorInfo,
    ErrorResponse,
    InvalidRequestError,
    error_headers,
    error_response,
    error_responses,
)
from adapter.limits import ConcurrencyLimiter
from adapter.local_preprocessing import LocalPreprocessing
from adapter.metrics import AdapterMetrics
from adapter.metrics import router as metrics_router
from adapter.middleware import RequestGuard
from adapter.models import OpenAIServingModels
from adapter.router import router as common_router
from adapter.scoring.router import router as scoring_router
from adapter.scoring.serving import OpenAIServingGenerativeScoring
from adapter.serving import ServingLimits
from adapter.settings import AdapterSettings
from adapter.shutdown import Lifecycle
from adapter.tokenize.router import router as tokenize_router
from adapter.tokenize.serving import OpenAIServingTokenization
from adapter.triton_client import TritonEngineClient

logger = logging.getLogger(__name__)


def invalid_request_from(exc: RequestValidationError) -> InvalidRequestError:
    """The first validation error as a 400: our own rule's message and field if it was one."""
    first = exc.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequestError):
        return cause
    if first.get("type") == "json_invalid" or isinstance(first.get("input"), bytes):
        return InvalidRequestError("The request body is not a valid JSON object.")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    where = ".".join(loc)
    message = f"{where}: {first['msg']}" if where else str(first["msg"])
    return InvalidRequestError(message, parameter=loc[0] if loc else None)


def _json_error(exc: Exception) -> JSONResponse:
    status, body = error_response(exc)
    return JSONResponse(body.model_dump(), status_code=status, headers=error_headers(exc))


def register_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error object; validation errors are 400, not 422."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _json_error(invalid_request_from(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = ErrorResponse(
            error=ErrorInfo(
                message=str(exc.detail),
                type="invalid_request_error" if exc.status_code < 500 else "server_error",
            )
        )
        # The exception's headers too, such as a 405's `Allow` (RFC 9110).
        return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)

    async def _expected(_: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, EngineError):
            logger.error("request failed: %s", exc)
        elif isinstance(exc, EngineUnavailableError):  # retryable: load shedding, a restart
            logger.warning("request refused: %s", exc)
        return _json_error(exc)

    # Handled here, these end the request normally; left to the `Exception` handler they would
    # be re-raised to uvicorn, which then drops the keep-alive connection.
    for kind in EXPECTED_ERRORS:
        app.add_exception_handler(kind, _expected)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        """A bug: a 500 error object for the client; Starlette re-raises it to be logged."""
        return _json_error(exc)


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without its 422 validation responses: the adapter answers 400 with an
    OpenAI error object instead (`register_error_handlers`)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path_item in schema.get("paths", {}).values():
            for operation in path_item.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(
    settings: AdapterSettings | None = None, engine: EngineClient | None = None
) -> FastAPI:
    """The app; `engine` replaces the Triton connection (unit tests pass a fake)."""
    settings = settings or AdapterSettings()
    metrics = AdapterMetrics()
    limiter = ConcurrencyLimiter(settings.max_concurrent_requests, settings.max_queued_requests)
    metrics.watch_waiting(lambda: limiter.waiting)
    lifecycle = Lifecycle()
    limits = ServingLimits.from_settings(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        triton: EngineClient = engine or TritonEngineClient(
            settings.triton_url,
            preprocessing_model=settings.preprocessing_model,
            llm_model=settings.llm_model,
            timeout_s=settings.triton_timeout_s,
        )
        if settings.local_preprocessing:
            triton = LocalPreprocessing(triton)
        if settings.api_key is None:
            logger.warning("no API key is set: /v1 is open to anyone who reaches the port")
        models = OpenAIServingModels(triton, settings.served_model_name)
        app.state.engine = triton
        app.state.models = models
        app.state.completion_serving = OpenAIServingCompletion(triton, models, limits, metrics)
        app.state.chat_serving = OpenAIServingChat(triton, models, limits, metrics)
        app.state.tokenization_serving = OpenAIServingTokenization(triton, models, limits, metrics)
        app.state.scoring_serving = OpenAIServingGenerativeScoring(triton, models, limits, metrics)
        try:
            yield
        finally:
            await triton.close()

    app = FastAPI(title="triton-logprobs OpenAI adapter", lifespan=lifespan)
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    app.state.limiter = limiter
    register_error_handlers(app)
    app.include_router(common_router)
    for router in (completions_router, chat_router, tokenize_router, scoring_router):
        app.include_router(router, responses=error_responses(*WORK_ERROR_STATUSES))
    app.include_router(metrics_router)
    app.add_middleware(
        RequestGuard,
        settings=settings,
        metrics=metrics,
        limiter=limiter,
        lifecycle=lifecycle,
    )
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    return app
