"""The adapter's limits against a fake engine: body size, `max_tokens` and `n` caps, the
concurrency slots and their queue, the per-request deadline, a client leaving early."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from adapter.app import create_app
from adapter.limits import ConcurrencyLimiter
from adapter.settings import AdapterSettings
from tests.adapter.asgi import serve, until
from tests.adapter.fakes import FakeEngine, model_script, output
from tests.adapter.sse import sse_payloads

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
TOKEN = output(tokens=[(97, b"a", -0.5)], completion_tokens=1)
FINAL = output(tokens=[(98, b"b", -0.5)], finish_reason="length", completion_tokens=2)


def completion(**fields: object) -> dict[str, object]:
    return {"model": "tiny", "prompt": "x", "max_tokens": 2, **fields}


def assert_error(response, status: int, code: str | None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    return error


@pytest.fixture
def limited(engine: FakeEngine) -> Iterator[TestClient]:
    settings = AdapterSettings(
        served_model_name="tiny", max_request_body_bytes=512, max_tokens_cap=8, max_n=2
    )
    engine.respond = model_script
    with TestClient(create_app(settings, engine=engine)) as client:
        yield client


def test_a_body_over_the_limit_is_413(limited: TestClient) -> None:
    error = assert_error(
        limited.post(COMPLETIONS, json=completion(prompt="x" * 600)), 413, "request_too_large"
    )
    assert error["message"] == "The request body is larger than 512 bytes."
    # Chunked, without Content-Length: refused as it grows past the limit.
    chunks = iter([b'{"model": "tiny", "prompt": "', b"x" * 600, b'"}'])
    assert_error(limited.post(COMPLETIONS, content=chunks), 413, "request_too_large")
    assert limited.post(COMPLETIONS, json=completion()).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, completion(max_tokens=9), "max_tokens"),
        (CHAT, {"messages": MESSAGES, "max_tokens": 9}, "max_tokens"),
        (CHAT, {"messages": MESSAGES, "max_completion_tokens": 9}, "max_completion_tokens"),
        (COMPLETIONS, completion(n=3), "n"),
        (CHAT, {"messages": MESSAGES, "n": 3}, "n"),
    ],
)
def test_caps_are_400_naming_the_field(
    limited: TestClient, path: str, body: dict, param: str
) -> None:
    error = assert_error(limited.post(path, json=body), 400, None, param)
    assert error["message"] == f"`{param}` must be at most {8 if 'tokens' in param else 2} " + (
        "(got 9)." if "tokens" in param else "(got 3)."
    )


def test_chat_without_a_limit_gets_the_cap(engine: FakeEngine, limited: TestClient) -> None:
    assert limited.post(CHAT, json={"messages": MESSAGES, "n": 2}).status_code == 200
    assert [params.max_tokens for params, _ in engine.requests] == [8, 8]  # cap < context 64


def queued_app(engine: FakeEngine, **settings: object):
    return create_app(
        AdapterSettings(
            served_model_name="tiny", max_concurrent_requests=1, max_queued_requests=1, **settings
        ),
        engine=engine,
    )


async def test_requests_past_the_slots_wait_and_past_the_queue_get_429(
    engine: FakeEngine,
) -> None:
    gate = asyncio.Event()
    engine.respond = lambda params: [gate, FINAL]
    app = queued_app(engine)
    limiter: ConcurrencyLimiter = app.state.limiter
    async with serve(app) as client:
        first = asyncio.ensure_future(client.post(COMPLETIONS, json=completion()))
        await until(lambda: len(engine.requests) == 1)
        second = asyncio.ensure_future(client.post(COMPLETIONS, json=completion()))
        await until(lambda: limiter.waiting == 1)
        refused = await client.post(COMPLETIONS, json=completion())
        error = assert_error(refused, 429, "rate_limit_exceeded")
        assert error["type"] == "requests"
        assert refused.headers["retry-after"] == "1"
        # Routes that do not call Triton take no slot.
        assert (await client.get("/v1/models")).status_code == 200
        assert len(engine.requests) == 1  # the second one waits in the adapter
        gate.set()
        assert [(await r).status_code for r in (first, second)] == [200, 200]
    assert (limiter.active, limiter.waiting) == (0, 0)


async def test_the_deadline_cancels_a_pending_response_with_504(engine: FakeEngine) -> None:
    engine.respond = lambda params: [asyncio.Event(), FINAL]  # never answers
    app = create_app(
        AdapterSettings(served_model_name="tiny", request_timeout_s=0.2), engine=engine
    )
    async with serve(app) as client:
        response = await client.post(COMPLETIONS, json=completion())
    error = assert_error(response, 504, "timeout")
    assert error["message"] == "The request did not finish within 0.2 s."
    assert (engine.closed, engine.finished) == (1, 0)  # the Triton stream was cancelled


async def test_the_deadline_ends_a_stream_with_an_error_event(engine: FakeEngine) -> None:
    """The deadline must not come before the stream has started: a second, not a blink."""
    engine.respond = lambda params: [TOKEN, asyncio.Event(), FINAL]
    app = create_app(
        AdapterSettings(served_model_name="tiny", request_timeout_s=1.0), engine=engine
    )
    async with serve(app) as client:
        response = await client.post(COMPLETIONS, json=completion(stream=True, n=2))
    assert response.status_code == 200
    *chunks, error, done = sse_payloads(response.text)
    assert [chunk["choices"][0]["text"] for chunk in chunks] == ["a", "a"]
    assert error["error"]["code"] == "timeout"
    assert done == "[DONE]"
    assert (engine.closed, engine.finished) == (2, 0)


async def test_the_deadline_counts_the_wait_for_a_slot(engine: FakeEngine) -> None:
    """The second request must finish within the deadline: a second, not a blink."""
    engine.respond = model_script
    app = queued_app(engine, request_timeout_s=1.0)
    limiter: ConcurrencyLimiter = app.state.limiter
    async with serve(app) as client:
        held = limiter.reserve()  # the only slot, taken by the test
        assert_error(await client.post(COMPLETIONS, json=completion()), 504, "timeout")
        assert (len(engine.requests), limiter.waiting) == (0, 0)  # it never reached Triton
        held.close()
        assert (await client.post(COMPLETIONS, json=completion())).status_code == 200


async def test_a_client_leaving_before_the_response_cancels_triton(engine: FakeEngine) -> None:
    """Starlette cancels a stream when its client leaves, not a plain response: the middleware
    does, so an abandoned non-streamed request does not keep generating."""
    engine.respond = lambda params: [asyncio.Event(), FINAL]
    app = create_app(AdapterSettings(served_model_name="tiny"), engine=engine)
    left = asyncio.Event()
    body = b'{"model": "tiny", "prompt": "x"}'
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": COMPLETIONS,
        "raw_path": COMPLETIONS.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 9000),
    }
    async with app.router.lifespan_context(app):
        request = asyncio.ensure_future(app(scope, receive, send))
        await until(lambda: len(engine.requests) == 1)
        left.set()
        await asyncio.wait_for(request, 5)
    assert sent == []  # nobody to answer
    assert (engine.closed, engine.finished) == (1, 0)


async def test_the_limiter_hands_slots_over_in_arrival_order() -> None:
    limiter = ConcurrencyLimiter(max_active=1, max_waiting=3)
    order: list[str] = []

    async def use(name: str, gate: asyncio.Event) -> None:
        async with limiter.reserve():
            order.append(name)
            await gate.wait()

    gates = {name: asyncio.Event() for name in "abcd"}
    tasks = {name: asyncio.ensure_future(use(name, gates[name])) for name in "abcd"}
    await until(lambda: order == ["a"] and limiter.waiting == 3)
    tasks["b"].cancel()  # cancelled while queued: leaves the queue
    await until(lambda: limiter.waiting == 2)
    for name in "acd":
        gates[name].set()
    await asyncio.gather(tasks["a"], tasks["c"], tasks["d"])
    assert order == ["a", "c", "d"]
    assert (limiter.active, limiter.waiting) == (0, 0)


async def test_a_slot_handed_to_a_cancelled_waiter_passes_on() -> None:
    limiter = ConcurrencyLimiter(max_active=1, max_waiting=2)
    first = limiter.reserve()
    second, third = limiter.reserve(), limiter.reserve()
    first.close()  # hands the slot to `second`, which is cancelled before it runs
    second.close()
    async with third:  # the slot passed on
        assert (limiter.active, limiter.waiting) == (1, 0)
    assert limiter.active == 0
