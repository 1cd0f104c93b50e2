"""A disconnect storm through the real adapter and Triton: 400 streamed requests at concurrency
32, a quarter of the clients hanging up at random points (seeded). Every other request gets its
greedy text, the engine ends with no active sequence, and neither the adapter nor the `llm`
backend stub grows in memory from after the first 100 requests to after the last."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx
import pytest

from backend.tritonserver import backend_stubs
from tests.integration.openai_support import MODEL, metric, wait_for
from tests.integration.proc import resident_kib

REQUESTS = 400
WARMUP = 100  # memory is compared from after these to after the last
CONCURRENCY = 32
HANGUP_SHARE = 0.25
MAX_TOKENS = 12
# A client that hangs up asks for far more than it reads (up to MAX_TOKENS events), so that its
# request is still generating when it leaves, however the engine's tokens were merged into
# responses: each of them must be cancelled in Triton.
HANGUP_MAX_TOKENS = 240
SEED = 20240601
PROMPTS = ["Triton serves the model", "The quick brown fox", "Logprobs of labels", "日本語も"]
MAX_GROWTH = 0.10


@dataclass
class Outcome:
    index: int
    hung_up: bool
    text: str = ""
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None


def body(prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": max_tokens != MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }


async def one_request(
    client: httpx.AsyncClient, index: int, prompt: str, hang_up_after: int | None
) -> Outcome:
    """Streams one completion; with `hang_up_after` closes the connection after that many
    events (the context manager's exit drops a connection whose body is unread)."""
    outcome = Outcome(index, hung_up=hang_up_after is not None)
    try:
        tokens = MAX_TOKENS if hang_up_after is None else HANGUP_MAX_TOKENS
        request = body(prompt, True, tokens)
        async with client.stream("POST", "/v1/completions", json=request) as response:
            if response.status_code != 200:
                outcome.error = f"{response.status_code}: {(await response.aread())[:300]!r}"
                return outcome
            events = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if hang_up_after is not None and events >= hang_up_after:
                    return outcome
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    outcome.done = True
                    continue
                event = json.loads(payload)
                if "error" in event:
                    outcome.error = event["error"]["message"]
                    continue
                choice = event["choices"][0]
                outcome.text += choice["text"]
                outcome.finish_reason = choice["finish_reason"] or outcome.finish_reason
    except httpx.HTTPError as exc:
        outcome.error = repr(exc)
    return outcome


@pytest.mark.timeout(300)
async def test_disconnect_storm(adapter_server, triton_server) -> None:
    metrics = triton_server.metrics_url
    adapter_pid = adapter_server.pid
    stub_pid = next(s.process.pid for s in backend_stubs(triton_server.pid) if s.model == "llm")
    rng = random.Random(SEED)
    hang_ups = set(rng.sample(range(REQUESTS), int(REQUESTS * HANGUP_SHARE)))
    # A hang-up after 1..MAX_TOKENS events: before the first token up to the last.
    plan = [
        (i, PROMPTS[i % len(PROMPTS)], rng.randint(1, MAX_TOKENS) if i in hang_ups else None)
        for i in range(REQUESTS)
    ]
    cancelled_before = metric(metrics, "llm_cancelled_requests_total")
    finished_before = metric(metrics, "llm_finished_requests_total")
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=adapter_server.url, timeout=60, limits=limits) as client:
        reference = {}
        for prompt in PROMPTS:  # greedy, non-streamed, once per prompt
            reply = await client.post("/v1/completions", json=body(prompt, False))
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            reference[prompt] = (choice["text"], choice["finish_reason"])
        gate = asyncio.Semaphore(CONCURRENCY)

        async def bounded(index: int, prompt: str, hang_up_after: int | None) -> Outcome:
            async with gate:
                return await one_request(client, index, prompt, hang_up_after)

        started = time.monotonic()
        outcomes = await asyncio.gather(*(bounded(*p) for p in plan[:WARMUP]))
        rss_warm = resident_kib(adapter_pid), resident_kib(stub_pid)
        outcomes += await asyncio.gather(*(bounded(*p) for p in plan[WARMUP:]))
        seconds = time.monotonic() - started
    assert wait_for(lambda: metric(metrics, "llm_active_sequences") == 0, timeout_s=30)
    # Each request ends in the engine exactly once, finished or cancelled (the writer sends the
    # counters one by one, so wait for both to arrive). A hang-up's request is cancelled unless
    # it finished before the adapter saw the disconnect.
    engine_requests = REQUESTS + len(PROMPTS)

    def ended() -> float:
        finished = metric(metrics, "llm_finished_requests_total") - finished_before
        return finished + metric(metrics, "llm_cancelled_requests_total") - cancelled_before

    wait_for(lambda: ended() >= engine_requests)
    rss_end = resident_kib(adapter_pid), resident_kib(stub_pid)

    lost = [
        o
        for o in outcomes
        if not o.hung_up
        and (o.error or not o.done or (o.text, o.finish_reason) != reference[plan[o.index][1]])
    ]
    cancelled = metric(metrics, "llm_cancelled_requests_total") - cancelled_before
    print(
        f"\nstorm: {REQUESTS} streamed requests at concurrency {CONCURRENCY} in {seconds:.1f} s, "
        f"{len(hang_ups)} hang-ups ({cancelled:.0f} cancelled in Triton), {len(lost)} lost; "
        f"RSS KiB adapter {rss_warm[0]} -> {rss_end[0]}, llm stub {rss_warm[1]} -> {rss_end[1]}"
    )
    assert lost == [], lost[:5]
    assert ended() == engine_requests
    assert 0 < cancelled <= len(hang_ups)
    for before, after in zip(rss_warm, rss_end, strict=True):
        assert after < before * (1 + MAX_GROWTH), (rss_warm, rss_end)
