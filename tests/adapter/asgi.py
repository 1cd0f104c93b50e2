"""The app reached in-process with httpx, its lifespan running, so that tests can hold several
requests in flight at once (Starlette's TestClient serves one at a time)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI


@asynccontextmanager
async def serve(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://adapter", timeout=10) as client,
    ):
        yield client


async def until(condition: Callable[[], bool], steps: int = 10_000) -> None:
    """Lets the event loop run until `condition` holds: sequencing on the loop, not timing."""
    for _ in range(steps):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")
