"""`RequestGuard`, the ASGI middleware every HTTP request passes: request id, metrics and the
access log line, draining, the API key, the body size, the concurrency slot, the deadline and
the abort of a request whose client left.

A pure ASGI middleware rather than FastAPI dependencies: it sees a streamed response to its
end (its slot, latency and status), and refuses a request before its body is parsed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from adapter.access import KNOWN_PATHS, WORK_PATHS, PathKind, check_bearer, path_kind
from adapter.context import (
    REQUEST_ID_HEADER,
    RequestContext,
    bind_request,
    request_id_from,
)
from adapter.errors import (
    EXPECTED_ERRORS,
    RequestTimeoutError,
    ShuttingDownError,
    error_headers,
    error_response,
)
from adapter.limits import ConcurrencyLimiter, Reservation, read_body
from adapter.metrics import AdapterMetrics
from adapter.settings import AdapterSettings
from adapter.shutdown import Lifecycle

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499
"""The status counted for a request whose client left before any response (nginx's code)."""


@dataclass
class _Response:
    status: int | None = None

    @property
    def started(self) -> bool:
        return self.status is not None


class RequestGuard:
    """See the module docstring; the steps run in the order of `_guard`."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        settings: AdapterSettings,
        metrics: AdapterMetrics,
        limiter: ConcurrencyLimiter,
        lifecycle: Lifecycle,
    ) -> None:
        self.app = app
        self.settings = settings
        self.metrics = metrics
        self.limiter = limiter
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        context = RequestContext(request_id_from(headers.get(REQUEST_ID_HEADER)))
        response = _Response()
        id_header = (REQUEST_ID_HEADER.encode(), context.request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                response.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), id_header]}
            await send(message)

        self.metrics.in_flight.inc()
        with bind_request(context):
            try:
                await self._guard(scope, receive, send_with_id, headers, context, response)
            except Exception:
                # A bug: Starlette's outer error middleware answers it with a 500.
                response.status = response.status or 500
                raise
            finally:
                self.metrics.in_flight.dec()
                self._account(scope, context, response)

    def _account(self, scope: Scope, context: RequestContext, response: _Response) -> None:
        """The request's metrics and its one log line (no body: prompts are not logged)."""
        seconds = time.perf_counter() - context.arrived
        status = response.status or CLIENT_CLOSED
        self.metrics.observe_request(self._endpoint(scope), status, seconds)
        client = scope.get("client") or ("-", 0)
        logger.info(
            '%s "%s %s" %d in %.3f s', client[0], scope["method"], scope["path"], status, seconds
        )

    @staticmethod
    def _endpoint(scope: Scope) -> str:
        """The route's path template, which the router put in the scope (bounded label
        values); for a request refused before routing, its path when it is a known one."""
        route = scope.get("route")
        if route is not None:
            return getattr(route, "path_format", None) or route.path
        path = scope["path"]
        if path.startswith("/v1/models/"):
            return "/v1/models/{model_id}"
        return path if path in KNOWN_PATHS else "other"

    async def _guard(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: Headers,
        context: RequestContext,
        response: _Response,
    ) -> None:
        settings = self.settings
        kind = path_kind(scope["path"])
        work = scope["path"] in WORK_PATHS
        try:
            if self.lifecycle.draining and kind not in (PathKind.LIVENESS, PathKind.METRICS):
                raise ShuttingDownError()
            if kind is PathKind.API and settings.api_key is not None:
                check_bearer(headers, settings.api_key, what="This API")
            if kind is PathKind.METRICS and settings.metrics_api_key is not None:
                check_bearer(headers, settings.metrics_api_key, what="/metrics")
            body = await read_body(
                receive, settings.max_request_body_bytes, headers.get("content-length")
            )
            if body is None:  # the client left while sending
                return
            reservation = self.limiter.reserve() if work else None
        except EXPECTED_ERRORS as exc:
            await self._reply_error(exc, scope, receive, send)
            return
        await self._run(scope, receive, send, body, context, response, reservation)

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes,
        context: RequestContext,
        response: _Response,
        reservation: Reservation | None,
    ) -> None:
        """Runs the app in its own task, so a deadline, a shutdown or the client leaving can
        cancel it before its response starts; after that, a stream handles its own abort."""
        disconnected = asyncio.Event()
        replayed = False

        async def replay() -> Message:
            """The body read above, then (as a server does) `http.disconnect` when the client
            leaves: a streaming response listens for it to cancel itself."""
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def serve() -> None:
            if reservation is None:
                await self.app(scope, replay, send)
                return
            async with reservation:
                await self.app(scope, replay, send)

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()
            if not response.started:
                task.cancel()  # nobody is left to answer; cancelling frees Triton at once

        def abort(_: Exception) -> None:
            if not response.started:
                task.cancel()

        task = asyncio.ensure_future(serve())
        watcher = asyncio.ensure_future(watch_disconnect())
        timer = None
        timeout_s = self.settings.request_timeout_s
        if reservation is not None and timeout_s:
            timer = asyncio.get_running_loop().call_later(
                timeout_s - (time.perf_counter() - context.arrived),
                context.abort,
                RequestTimeoutError(timeout_s),
            )
        self.lifecycle.add(context)
        try:
            with context.on_abort(abort):
                await _wait_or_cancel(task)
        finally:
            self.lifecycle.discard(context)
            if timer is not None:
                timer.cancel()
            watcher.cancel()
            if reservation is not None:
                reservation.close()
        if task.cancelled():
            if context.aborted is not None and not response.started:
                await self._reply_error(context.aborted, scope, replay, send)
            return
        task.result()  # a bug: re-raised for Starlette's error middleware (500, logged)

    @staticmethod
    async def _reply_error(exc: BaseException, scope: Scope, receive: Receive, send: Send) -> None:
        status, body = error_response(exc)
        if isinstance(exc, RequestTimeoutError):
            logger.warning("%s", exc)  # the others show in the request's own log line
        reply = JSONResponse(body.model_dump(), status_code=status, headers=error_headers(exc))
        await reply(scope, receive, send)


async def _wait_or_cancel(task: asyncio.Future[None]) -> None:
    """Waits for `task` without letting its cancellation cancel the caller; if the caller is
    cancelled (the server stops), cancels the task and waits for it to end."""
    try:
        await asyncio.wait({task})
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait({task})
        raise
