"""Graceful shutdown against a fake engine: while draining new requests get 503 and
/health/ready says 503; requests in flight finish up to the bound, then a stream gets an
error event and [DONE], a pending response a 503."""

from __future__ import annotations

import asyncio
import signal

import httpx
import uvicorn

from adapter.app import create_app
from adapter.settings import AdapterSettings
from adapter.shutdown import GracefulServer, Lifecycle
from tests.adapter.asgi import serve, until
from tests.adapter.fakes import FakeEngine, output
from tests.adapter.sse import sse_payloads

COMPLETIONS = "/v1/completions"
TOKEN = output(tokens=[(97, b"a", -0.5)], completion_tokens=1)
FINAL = output(tokens=[(98, b"b", -0.5)], finish_reason="length", completion_tokens=2)
BODY = {"model": "tiny", "prompt": "x", "max_tokens": 2}


def app_on(engine: FakeEngine):
    return create_app(AdapterSettings(served_model_name="tiny"), engine=engine)


async def assert_draining(client: httpx.AsyncClient) -> None:
    """New requests and readiness get 503 (closing the connection); liveness and metrics
    answer."""
    refused = await client.post(COMPLETIONS, json=BODY)
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == "The server is shutting down."
    assert refused.headers["connection"] == "close"
    assert (await client.get("/health/ready")).status_code == 503
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/metrics")).status_code == 200


async def test_a_stream_in_flight_finishes_within_the_bound(engine: FakeEngine) -> None:
    gate = asyncio.Event()
    engine.respond = lambda params: [TOKEN, gate, FINAL]
    app = app_on(engine)
    lifecycle: Lifecycle = app.state.lifecycle
    async with serve(app) as client:
        stream = asyncio.ensure_future(client.post(COMPLETIONS, json={**BODY, "stream": True}))
        await until(lambda: len(engine.requests) == 1)
        drain = asyncio.ensure_future(lifecycle.drain(timeout_s=30))
        await until(lambda: lifecycle.draining)
        await assert_draining(client)
        assert not drain.done()  # waits for the stream
        gate.set()
        await asyncio.wait_for(drain, 5)
        payloads = sse_payloads((await stream).text)
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert engine.finished == 1


async def test_past_the_bound_a_stream_gets_an_error_event(engine: FakeEngine) -> None:
    engine.respond = lambda params: [TOKEN, asyncio.Event(), FINAL]  # never finishes
    app = app_on(engine)
    async with serve(app) as client:
        stream = asyncio.ensure_future(client.post(COMPLETIONS, json={**BODY, "stream": True}))
        await until(lambda: len(engine.requests) == 1)
        await asyncio.wait_for(app.state.lifecycle.drain(timeout_s=0.05), 5)
        response = await stream
    assert response.status_code == 200
    *_, error, done = sse_payloads(response.text)
    assert error["error"]["code"] == "service_unavailable"
    assert error["error"]["message"] == "The server is shutting down."
    assert done == "[DONE]"
    assert (engine.closed, engine.finished) == (1, 0)  # the Triton request was cancelled


async def test_past_the_bound_a_pending_response_is_503(engine: FakeEngine) -> None:
    engine.respond = lambda params: [asyncio.Event(), FINAL]
    app = app_on(engine)
    async with serve(app) as client:
        pending = asyncio.ensure_future(client.post(COMPLETIONS, json=BODY))
        await until(lambda: len(engine.requests) == 1)
        await asyncio.wait_for(app.state.lifecycle.drain(timeout_s=0.05), 5)
        response = await pending
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "The server is shutting down."
    assert (engine.closed, engine.finished) == (1, 0)


async def test_the_server_drains_on_the_first_signal_and_exits_after() -> None:
    lifecycle = Lifecycle()
    server = GracefulServer(uvicorn.Config(app_on(FakeEngine())), lifecycle, drain_timeout_s=1)
    server.handle_exit(signal.SIGTERM, None)
    assert lifecycle.draining and not server.should_exit
    assert not await server.on_tick(1)  # starts the drain: nothing in flight
    await until(lambda: server._drain is not None and server._drain.done())
    assert await server.on_tick(2)
    assert server.should_exit
