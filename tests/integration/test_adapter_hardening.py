"""The adapter's access and limits through uvicorn and the session's Triton: the API key (also
through the launcher), each limit hit once and answered as documented, the request id in the
response and the log, the per-request timeout cancelling Triton, and SIGTERM draining."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from backend.adapter_server import AdapterServer
from backend.launcher import build_adapter, parse_args
from tests.integration.openai_support import (
    MODEL,
    adapter_metric,
    held,
    metric,
    sse_events,
    wait_for,
)

KEY = "sk-integration"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"model": MODEL, "prompt": "Hi", "max_tokens": 240, "ignore_eos": True, "n": 2}
LIMITS = {
    "max_request_body_bytes": 8192,
    "max_tokens_cap": 240,
    "max_n": 2,
    "max_concurrent_requests": 1,
    "max_queued_requests": 1,
}


@contextlib.contextmanager
def adapter(triton_server, tmp_path: Path, name: str, **options: object) -> Iterator[AdapterServer]:
    api_key = options.pop("api_key", None)
    server = AdapterServer(
        triton_server.grpc_url,
        port=0,
        served_model_name=MODEL,
        log_path=tmp_path / f"{name}.log",
        api_key=api_key,  # type: ignore[arg-type]
        options=options,
    )
    with server:
        yield server


@pytest.fixture(scope="module")
def limited(triton_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AdapterServer]:
    run = tmp_path_factory.mktemp("limited")
    with adapter(triton_server, run, "limited", api_key=KEY, **LIMITS) as server:
        yield server


@pytest.fixture
def http(limited: AdapterServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=limited.url, timeout=60, headers=AUTH) as client:
        yield client


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def completion(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


def test_the_api_key(limited: AdapterServer) -> None:
    with httpx.Client(base_url=limited.url, timeout=30) as anonymous:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
                refused = anonymous.request(method, path, json=completion(), headers=headers)
                assert error_of(refused, 401)["code"] == "invalid_api_key"
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/health/ready").status_code == 200
    with openai.OpenAI(base_url=limited.base_url, api_key=KEY, max_retries=0) as client:
        # ignore_eos: the default temperature samples, and an early EOS would end it sooner.
        created = client.completions.create(**completion(), extra_body={"ignore_eos": True})
        assert created.usage is not None and created.usage.completion_tokens == 2
    with (
        openai.OpenAI(base_url=limited.base_url, api_key="sk-wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()


def test_the_launcher_passes_the_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make serve ARGS="--api-key X"`: the adapter gets it in its environment, not its argv;
    without the flag ADAPTER_API_KEY is inherited."""
    triton = type("Triton", (), {"grpc_url": "127.0.0.1:1"})()
    server = build_adapter(parse_args(["--api-key", "sk-flag"]), triton)  # type: ignore[arg-type]
    assert server is not None
    assert server.env()["ADAPTER_API_KEY"] == "sk-flag"
    assert "sk-flag" not in " ".join(server.command())
    monkeypatch.setenv("ADAPTER_API_KEY", "sk-env")
    inherited = build_adapter(parse_args([]), triton)  # type: ignore[arg-type]
    assert inherited is not None and inherited.env()["ADAPTER_API_KEY"] == "sk-env"


def test_body_size_caps_ids_and_context(http: httpx.Client) -> None:
    assert (
        error_of(http.post("/v1/completions", json=completion(prompt="x" * 9000)), 413)["code"]
        == "request_too_large"
    )
    for field, value in (("max_tokens", 241), ("n", 3)):
        error = error_of(http.post("/v1/completions", json=completion(**{field: value})), 400)
        assert error["param"] == field and "must be at most" in error["message"]
    ids = completion(logprobs=0, logprob_token_ids=list(range(1025)))
    error = error_of(http.post("/v1/completions", json=ids), 400)  # the llm config's 1024
    assert error["param"] == "logprob_token_ids" and "at most 1024" in error["message"]
    error = error_of(http.post("/v1/completions", json=completion(prompt=[5] * 300)), 400)
    assert (
        error["param"] == "prompt"
        and "this model's maximum context length is 256 tokens" in error["message"]
    )


def test_past_the_slot_and_the_queue_429(
    http: httpx.Client, limited: AdapterServer, triton_server
) -> None:
    with ThreadPoolExecutor(1) as pool, contextlib.ExitStack() as stack:
        with held(triton_server):  # the stream cannot finish: it holds the only slot
            holding = stack.enter_context(
                http.stream("POST", "/v1/completions", json={**LONG, "stream": True})
            )
            assert holding.status_code == 200
            # ignore_eos: the default temperature samples, and an early EOS would end it sooner.
            queued = pool.submit(http.post, "/v1/completions", json=completion(ignore_eos=True))
            assert wait_for(lambda: adapter_metric(limited, "adapter_requests_waiting") == 1)
            refused = http.post("/v1/completions", json=completion())
            assert error_of(refused, 429)["code"] == "rate_limit_exceeded"
            assert refused.headers["retry-after"] == "1"
        *_, last, done = sse_events(list(holding.iter_lines()))
        assert last["choices"][0]["finish_reason"] == "length" and done == "[DONE]"
        reply = queued.result()
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_the_request_id_reaches_the_response_and_the_log(
    http: httpx.Client, limited: AdapterServer
) -> None:
    body = completion(prompt="a-private-prompt")
    reply = http.post("/v1/completions", json=body, headers={"X-Request-Id": "it-42"})
    assert reply.headers["x-request-id"] == "it-42" and reply.json()["id"] == "cmpl-it-42"
    assert wait_for(lambda: '[it-42]: 127.0.0.1 "POST /v1/completions" 200' in log(limited))
    assert "a-private-prompt" not in log(limited)


def log(server: AdapterServer) -> str:
    assert server.log_path is not None
    return server.log_path.read_text(errors="replace")


def test_the_timeout_cancels_the_triton_requests(triton_server, tmp_path: Path) -> None:
    """Held after their first tokens, the requests can only end by the timeout: a stream with
    an error event, a plain request with 504; the Triton requests of both choices of both are
    cancelled, not generated to the end. The timeout is long enough for a fresh adapter on a
    busy machine to stream both first tokens, which the error event must follow."""
    metrics = triton_server.metrics_url
    cancelled = metric(metrics, "llm_cancelled_requests_total")
    with (
        adapter(triton_server, tmp_path, "timeout", request_timeout_s=5.0) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        with held(triton_server):
            streamed = client.post("/v1/completions", json={**LONG, "stream": True})
            *chunks, error, done = sse_events(streamed.text.splitlines())
            assert chunks and error["error"]["code"] == "timeout" and done == "[DONE]"
            assert error_of(client.post("/v1/completions", json=LONG), 504)["code"] == "timeout"
        assert wait_for(lambda: metric(metrics, "llm_cancelled_requests_total") == cancelled + 4)
        assert wait_for(lambda: metric(metrics, "llm_active_sequences") == 0)


def test_sigterm_drains_the_stream_in_flight(triton_server, tmp_path: Path) -> None:
    """SIGTERM: new requests and readiness get 503 while the stream in flight finishes; then
    the adapter exits 0. The stream is held after its first token until those are checked, so
    that it cannot finish (and the adapter exit) first; the drain bound is far beyond it."""
    metrics = triton_server.metrics_url
    with adapter(triton_server, tmp_path, "drain", drain_timeout_s=600.0) as server:
        process = server._process
        assert process is not None
        with httpx.Client(base_url=server.url, timeout=60) as client:
            request = client.build_request("POST", "/v1/completions", json={**LONG, "stream": True})
            with held(triton_server):
                stream = client.send(request, stream=True)
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                process.send_signal(signal.SIGTERM)
                with httpx.Client(base_url=server.url, timeout=60) as fresh:  # it drains
                    assert wait_for(lambda: fresh.get("/health/ready").status_code == 503)
                    refused = fresh.post("/v1/completions", json=completion())
                    assert error_of(refused, 503)["message"] == "The server is shutting down."
                    assert fresh.get("/health").status_code == 200
            *_, last, done = sse_events(list(lines))
            stream.close()
        assert done == "[DONE]"
        assert last["choices"][0]["finish_reason"] == "length"
        assert_exits_cleanly(server)
    assert wait_for(lambda: metric(metrics, "llm_active_sequences") == 0)


def test_sigterm_past_the_drain_bound_cuts_the_stream(triton_server, tmp_path: Path) -> None:
    """Held after its first token, the stream cannot finish within the 0.3 s bound: it ends
    with an error event, its Triton requests are cancelled, and the adapter exits 0."""
    metrics = triton_server.metrics_url
    cancelled = metric(metrics, "llm_cancelled_requests_total")
    with adapter(triton_server, tmp_path, "cut", drain_timeout_s=0.3) as server:
        process = server._process
        assert process is not None
        with (
            held(triton_server),
            httpx.Client(base_url=server.url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream,
        ):
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)
            *_, last, done = sse_events(list(lines))
            assert last["error"]["message"] == "The server is shutting down."
            assert done == "[DONE]"
            assert_exits_cleanly(server)
    assert wait_for(lambda: metric(metrics, "llm_cancelled_requests_total") == cancelled + 2)
    assert wait_for(lambda: metric(metrics, "llm_active_sequences") == 0)


def assert_exits_cleanly(server: AdapterServer) -> None:
    assert server._process is not None
    try:
        assert server._process.wait(timeout=60) == 0
    except subprocess.TimeoutExpired:
        pytest.fail(f"the adapter did not exit after the drain\n{server.log_tail()}")
