"""Graceful shutdown: the requests in flight, the drain that ends them, and the uvicorn server
that drains on SIGTERM before it stops.

uvicorn's own shutdown closes the listener at once and then waits, without bound, for open
responses; a long stream would hold the process until Kubernetes kills it and the client
would see a cut connection. Draining first keeps the port answering (503 for new requests,
/health/ready 503 so load balancers move away), lets requests in flight finish up to a bound,
then aborts the rest: a stream gets an error event and [DONE], a pending response a 503.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from adapter.context import RequestContext
from adapter.errors import ShuttingDownError

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 2.0
"""After the abort: how long aborted requests get to send their error and end."""


class Lifecycle:
    """The requests in flight (the middleware adds and discards them) and the draining flag."""

    def __init__(self) -> None:
        self.draining = False
        self._in_flight: set[RequestContext] = set()
        self._idle: asyncio.Event | None = None

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def add(self, context: RequestContext) -> None:
        self._in_flight.add(context)

    def discard(self, context: RequestContext) -> None:
        self._in_flight.discard(context)
        if not self._in_flight and self._idle is not None:
            self._idle.set()

    def start_draining(self) -> None:
        """From here on new requests get 503. Only sets a flag: safe in a signal handler."""
        self.draining = True

    async def drain(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for the requests in flight, then aborts the rest and gives
        them `ABORT_GRACE_S` to answer."""
        self.start_draining()
        logger.info("draining: %d requests in flight, up to %g s", self.in_flight, timeout_s)
        if await self._wait_idle(timeout_s):
            return
        logger.warning("drain bound passed: aborting %d requests", self.in_flight)
        for context in list(self._in_flight):
            context.abort(ShuttingDownError())
        if not await self._wait_idle(ABORT_GRACE_S):
            logger.error("%d requests did not end after the abort", self.in_flight)

    async def _wait_idle(self, timeout_s: float) -> bool:
        if not self._in_flight:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        finally:
            self._idle = None
        return True


class GracefulServer(uvicorn.Server):
    """uvicorn that drains `lifecycle` on the first SIGTERM / SIGINT, then shuts down as usual;
    a second signal is uvicorn's (SIGINT then exits at once)."""

    def __init__(
        self, config: uvicorn.Config, lifecycle: Lifecycle, drain_timeout_s: float
    ) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout_s = drain_timeout_s
        self._drain: asyncio.Future[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.draining or self.should_exit:
            super().handle_exit(sig, frame)
        else:
            self.lifecycle.start_draining()

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's main loop calls this every 0.1 s: start the drain, exit when it is done."""
        if self.lifecycle.draining and self._drain is None:
            self._drain = asyncio.ensure_future(self.lifecycle.drain(self.drain_timeout_s))
        if self._drain is not None and self._drain.done():
            self.should_exit = True
        return await super().on_tick(counter)
