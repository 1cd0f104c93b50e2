"""Request limits enforced before a request reaches its route: the body size and the number of
requests served at once (with a bounded wait queue in front)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from types import TracebackType

from starlette.types import Message, Receive

from adapter.errors import RequestTooLargeError, TooManyRequestsError


async def read_body(receive: Receive, limit: int, content_length: str | None) -> bytes | None:
    """The whole request body, or None when the client went away while sending it.

    Refuses a body over `limit` bytes from its Content-Length at once, and a chunked one as
    soon as it grows past the limit, so an oversized body is never held in memory.
    """
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise RequestTooLargeError(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestTooLargeError(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class ConcurrencyLimiter:
    """At most `max_active` requests at once, `max_waiting` more waiting in arrival order; the
    next one is refused (429). `max_active` 0: no limit.

    No asyncio primitive is made before it is needed, so one limiter serves whichever event
    loop runs the app (test clients start their own).
    """

    def __init__(self, max_active: int, max_waiting: int, *, retry_after_s: int = 1) -> None:
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def reserve(self) -> Reservation:
        """A place: a slot now, or a place in the queue (`async with` waits for the slot).

        Synchronous, so the count is exact however many requests arrive together.
        """
        if not self.max_active or (self.active < self.max_active and not self._waiters):
            self.active += 1
            return Reservation(self, None)
        if len(self._waiters) >= self.max_waiting:
            raise TooManyRequestsError(
                f"The server is at its limit of {self.max_active} concurrent requests and "
                f"{self.max_waiting} waiting ones; retry later.",
                retry_after_s=self.retry_after_s,
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return Reservation(self, waiter)

    def leave_queue(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)

    def release(self) -> None:
        """Hands the slot to the longest waiter, or frees it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: `active` stays the same
                return
        self.active -= 1


class Reservation:
    """`async with`: waits for the slot if queued, frees it on exit. `close` is idempotent and
    also right for a reservation never entered (its task cancelled before it ran): a queued
    place leaves the queue, a slot handed over meanwhile passes on."""

    def __init__(self, limiter: ConcurrencyLimiter, waiter: asyncio.Future[None] | None) -> None:
        self._limiter = limiter
        self._waiter = waiter
        self._closed = False

    async def __aenter__(self) -> None:
        if self._waiter is None:
            return
        try:
            await self._waiter
        except asyncio.CancelledError:
            self.close()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        waiter = self._waiter
        if waiter is None or (waiter.done() and not waiter.cancelled()):
            self._limiter.release()
            return
        waiter.cancel()
        self._limiter.leave_queue(waiter)
