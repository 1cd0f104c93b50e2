"""The request being served (its id, arrival, deadline and abort) and the log filter that
stamps its id on every log line written while serving it.

The middleware binds a `RequestContext` to a context variable; tasks the request starts (the
streaming response, the Triton streams) copy it, so serving code and logs reach it without
passing it along.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID_PATTERN = r"[A-Za-z0-9._:\-]{1,128}"
"""Accepted request ids: what tracing systems send (UUIDs, W3C trace ids, ULIDs), nothing that
could forge a log line or a Triton id."""
_VALID_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)

AbortListener = Callable[[Exception], None]


@dataclass(eq=False)
class RequestContext:
    """One HTTP request. `abort` ends it early with an error (timeout, shutdown): each listener
    decides how (the middleware cancels a request whose response has not started; a stream
    sends the error as an event)."""

    request_id: str
    arrived: float = field(default_factory=time.perf_counter)
    """`time.perf_counter()` at arrival: the start of its latency metrics."""
    aborted: Exception | None = None
    _listeners: list[AbortListener] = field(default_factory=list)

    def abort(self, error: Exception) -> None:
        """Ends the request with `error`; only the first abort counts."""
        if self.aborted is not None:
            return
        self.aborted = error
        for listener in list(self._listeners):
            listener(error)

    @contextmanager
    def on_abort(self, listener: AbortListener) -> Iterator[None]:
        """Calls `listener` on abort while inside; at once if the request was already aborted
        (an abort between the response start and the stream's registration is not lost)."""
        if self.aborted is not None:
            listener(self.aborted)
        self._listeners.append(listener)
        try:
            yield
        finally:
            self._listeners.remove(listener)


_current: ContextVar[RequestContext | None] = ContextVar("adapter_request", default=None)


def current_request() -> RequestContext | None:
    return _current.get()


def current_request_id() -> str:
    """The id of the request being served, or a new one outside a request (direct calls)."""
    context = _current.get()
    return context.request_id if context is not None else uuid.uuid4().hex


def request_id_from(header: str | None) -> str:
    """The client's `X-Request-Id` when it is a plain token, else a fresh one."""
    if header is not None and _VALID_REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


@contextmanager
def bind_request(context: RequestContext) -> Iterator[RequestContext]:
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id` ("-" outside a request) for formats with `%(request_id)s`;
    attach it to the handler, so records of every logger (uvicorn's too) get it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            context = _current.get()
            record.request_id = context.request_id if context is not None else "-"
        return True
