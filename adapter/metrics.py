"""The adapter's Prometheus metrics (`GET /metrics`): requests by endpoint and status, in-flight
and waiting requests, end-to-end latency, time to first token, time per output token, prompt
and generated tokens.

Each app has its own registry, so several apps in one process (tests) do not collide. The
engine's own metrics (active sequences, KV-cache usage, ...) are on Triton's metrics port.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from adapter.access import METRICS_PATH
from adapter.context import current_request
from adapter.tensors import TritonOutput

# vLLM's buckets (vllm/v1/metrics/loggers.py), with finer ones below 10 ms: a small model on a
# GPU makes a token in about 1 ms.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
TPOT_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
)


class AdapterMetrics:
    """The metric objects of one app, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "adapter_requests",
            "HTTP requests by route and status (499: the client left before the response).",
            ["endpoint", "status"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "adapter_requests_in_flight", "HTTP requests being served.", registry=registry
        )
        self.waiting = Gauge(
            "adapter_requests_waiting",
            "Requests waiting for a concurrency slot.",
            registry=registry,
        )
        self.latency = Histogram(
            "adapter_request_duration_seconds",
            "End-to-end latency, arrival to the last byte of the response.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "adapter_time_to_first_token_seconds",
            "Arrival of the HTTP request to the first generated token of each Triton request.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            "adapter_time_per_output_token_seconds",
            "Mean time between generated tokens of each Triton request after the first.",
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "adapter_prompt_tokens", "Prompt tokens of Triton requests.", registry=registry
        )
        self.generation_tokens = Counter(
            "adapter_generation_tokens",
            "Tokens generated, cancelled requests' included.",
            registry=registry,
        )

    def watch_waiting(self, count: Callable[[], int]) -> None:
        """The waiting gauge reads `count` at each scrape."""
        self.waiting.set_function(count)

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.latency.labels(endpoint=endpoint).observe(seconds)

    def track_generation(self) -> GenerationTracker:
        return GenerationTracker(self)


class GenerationTracker:
    """The token metrics of one Triton request, fed each of its responses in order."""

    def __init__(self, metrics: AdapterMetrics) -> None:
        self._metrics = metrics
        context = current_request()
        self._arrived = context.arrived if context is not None else time.perf_counter()
        self._first_token_at: float | None = None
        self._prompt_counted = False

    def observe(self, output: TritonOutput) -> None:
        metrics = self._metrics
        now = time.perf_counter()
        if not self._prompt_counted:
            self._prompt_counted = True
            metrics.prompt_tokens.inc(output.prompt_tokens)
        if output.output_ids:
            metrics.generation_tokens.inc(len(output.output_ids))
            if self._first_token_at is None:
                self._first_token_at = now
                metrics.time_to_first_token.observe(now - self._arrived)
        if output.final and self._first_token_at is not None and output.completion_tokens > 1:
            per_token = (now - self._first_token_at) / (output.completion_tokens - 1)
            metrics.time_per_output_token.observe(per_token)


router = APIRouter()


@router.get(METRICS_PATH, include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text format; the middleware checks the metrics key when one is set."""
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
