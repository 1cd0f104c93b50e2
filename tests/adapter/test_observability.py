"""Request ids (X-Request-Id in, out and to Triton), log lines that carry them and no prompt,
and the adapter's Prometheus metrics."""

from __future__ import annotations

import logging
import re

import pytest
from fastapi.testclient import TestClient

from adapter.context import RequestIdFilter
from adapter.errors import EngineError, EngineUnavailableError
from tests.adapter.fakes import FakeEngine, output

SECRET_PROMPT = "my-secret-prompt"
SECRET_OUTPUT = "my-secret-output"
SCRIPT = [
    output(tokens=[(1, SECRET_OUTPUT.encode(), -0.5)], completion_tokens=1),
    output(tokens=[(2, b"!", -0.25)], finish_reason="length", prompt_tokens=3, completion_tokens=2),
]


def completion(**fields: object) -> dict[str, object]:
    return {"model": "tiny", "prompt": SECRET_PROMPT, "max_tokens": 2, **fields}


def test_the_request_id_is_echoed_and_carried_to_triton(
    engine: FakeEngine, client: TestClient
) -> None:
    engine.script = SCRIPT
    response = client.post(
        "/v1/completions", json=completion(n=2), headers={"X-Request-Id": "trace-42"}
    )
    assert response.headers["x-request-id"] == "trace-42"
    assert response.json()["id"] == "cmpl-trace-42"
    assert [request_id for _, request_id in engine.requests] == [
        "cmpl-trace-42-0",
        "cmpl-trace-42-1",
    ]


@pytest.mark.parametrize("given", [None, "x" * 129, "two words", "new\\nline"])
def test_a_missing_or_unsafe_request_id_is_replaced(
    engine: FakeEngine, client: TestClient, given: str | None
) -> None:
    engine.script = SCRIPT
    headers = {} if given is None else {"X-Request-Id": given}
    response = client.post("/v1/completions", json=completion(), headers=headers)
    made = response.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    assert engine.requests[0][1] == f"cmpl-{made}-0"
    # Errors carry it too.
    refused = client.post("/v1/completions", json=completion(logprobs=99))
    assert refused.status_code == 400 and refused.headers["x-request-id"] != made


def test_log_lines_carry_the_request_id_and_no_prompt_or_output(
    engine: FakeEngine, client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.handler.addFilter(RequestIdFilter())
    caplog.set_level(logging.DEBUG)
    engine.script = SCRIPT
    client.post("/v1/completions", json=completion(stream=True), headers={"X-Request-Id": "r-1"})
    engine.script = [EngineError("stream broke")]
    client.post("/v1/completions", json=completion(), headers={"X-Request-Id": "r-2"})
    ours = [r for r in caplog.records if r.name.startswith("adapter")]
    access = [r for r in ours if r.name == "adapter.middleware"]
    assert [(r.request_id, r.getMessage().split('"')[1]) for r in access] == [
        ("r-1", "POST /v1/completions"),
        ("r-2", "POST /v1/completions"),
    ]
    assert {r.request_id for r in ours if "stream broke" in r.getMessage()} == {"r-2"}
    assert SECRET_PROMPT not in caplog.text and SECRET_OUTPUT not in caplog.text


def test_a_failure_logs_an_error_and_a_busy_engine_a_warning(
    engine: FakeEngine, client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Shedding load under overload is expected: an ERROR line per refused request would
    flood the log that a real failure should stand out in."""
    caplog.set_level(logging.INFO, logger="adapter")
    engine.script = [EngineError("stream broke")]
    assert client.post("/v1/completions", json=completion()).status_code == 500
    engine.script = [EngineUnavailableError("server busy: 256 requests are waiting")]
    assert client.post("/v1/completions", json=completion()).status_code == 503
    levels = {r.getMessage(): r.levelname for r in caplog.records if r.name == "adapter.app"}
    assert levels == {
        "request failed: stream broke": "ERROR",
        "request refused: server busy: 256 requests are waiting": "WARNING",
    }


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    pattern = rf"^{name}(?:\{{{wanted}\}})? ([0-9.e+-]+)$" if labels else rf"^{name} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{name}{{{wanted}}} not in\n{text}"
    return float(match.group(1))


def test_metrics_count_requests_latency_and_tokens(engine: FakeEngine, client: TestClient) -> None:
    engine.script = SCRIPT
    for stream in (False, True):
        assert client.post("/v1/completions", json=completion(stream=stream)).status_code == 200
    assert client.post("/v1/completions", json=completion(logprobs=99)).status_code == 400
    assert client.get("/v1/models/tiny").status_code == 200
    text = client.get("/metrics").text
    requests = "adapter_requests_total"
    assert metric(text, requests, endpoint="/v1/completions", status="200") == 2
    assert metric(text, requests, endpoint="/v1/completions", status="400") == 1
    assert metric(text, requests, endpoint="/v1/models/{model_id}", status="200") == 1
    assert metric(text, "adapter_request_duration_seconds_count", endpoint="/v1/completions") == 3
    assert metric(text, "adapter_time_to_first_token_seconds_count") == 2
    assert metric(text, "adapter_time_per_output_token_seconds_count") == 2
    assert metric(text, "adapter_prompt_tokens_total") == 6  # 3 per request
    assert metric(text, "adapter_generation_tokens_total") == 4
    assert metric(text, "adapter_requests_in_flight") == 1  # this scrape
    assert metric(text, "adapter_requests_waiting") == 0
