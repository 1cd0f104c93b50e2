"""A client that goes away mid-stream ends its Triton request and frees the sequence: the
adapter sends a CANCEL on the request's stream (docs/tensors.md, "Ending a request"); a CANCEL
that `llm` refused would leave the request generating to MAX_TOKENS, counted as finished."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.openai_support import (
    MODEL,
    adapter_metric,
    assert_generated_since,
    held,
    metric,
    wait_for,
)

MAX_TOKENS = 200  # with the chat template's prompt, within the 256-token context
LONG = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "Triton", **LONG}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **LONG},
        ),
    ],
)
def test_disconnect_cancels_the_triton_request(
    adapter_server, triton_server, path: str, body: dict
) -> None:
    metrics = triton_server.metrics_url
    assert wait_for(lambda: metric(metrics, "llm_active_sequences") == 0)
    cancelled = metric(metrics, "llm_cancelled_requests_total")
    generated = metric(metrics, "llm_generated_tokens_total")
    with (
        held(triton_server),  # it cannot finish before the hang-up
        httpx.Client(base_url=adapter_server.url, timeout=30) as client,
    ):
        with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            assert next(line for line in response.iter_lines() if line.startswith("data: "))
        # The connection is closed, long before MAX_TOKENS. The engine goes on only once the
        # adapter has seen it and sent the CANCEL (only the scrape is in flight).
        assert wait_for(lambda: adapter_metric(adapter_server, "adapter_requests_in_flight") == 1)
    assert wait_for(lambda: metric(metrics, "llm_cancelled_requests_total") == cancelled + 1)
    assert wait_for(lambda: metric(metrics, "llm_active_sequences") == 0)
    stopped_at = metric(metrics, "llm_generated_tokens_total")
    assert stopped_at - generated < MAX_TOKENS
    finished = metric(metrics, "llm_finished_requests_total")
    with httpx.Client(base_url=adapter_server.url, timeout=30) as client:
        after = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        )
    assert after.status_code == 200
    assert_generated_since(metrics, stopped_at, finished, tokens=2)
