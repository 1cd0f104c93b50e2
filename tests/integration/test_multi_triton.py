"""Two tritonservers behind one adapter (`--triton-url a,b`): requests are spread over both, and
once one is stopped every request is served by the other, the first one failing over.

Its own tritonservers, not the session's: one of them is stopped."""

from __future__ import annotations

import contextlib
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from backend.adapter_server import AdapterServer
from backend.repository import write_repository
from backend.tritonserver import TritonServer
from tests.conftest import TEST_PARAMETERS
from tests.integration.openai_support import MODEL, wait_for

REQUESTS = 8
GREEDY = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


def finished_requests(server: TritonServer) -> float:
    """The `llm` model's `llm_finished_requests_total`, summed over its label sets."""
    text = httpx.get(server.metrics_url, timeout=10).text
    return sum(
        float(value)
        for value in re.findall(r"^llm_finished_requests_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    )


def complete(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.timeout(600)
def test_requests_are_balanced_and_fail_over(model_dir: Path, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(2) as pool:  # ~15 s each: start both at once
            starts = [
                pool.submit(
                    TritonServer(
                        write_repository(tmp_path / f"repo-{i}", model_dir, TEST_PARAMETERS),
                        http_port=0,
                        grpc_port=0,
                        metrics_port=0,
                        log_path=tmp_path / f"triton-{i}.log",
                    ).start_ready,
                    240,
                )
                for i in (1, 2)
            ]
        for start in starts:  # every server that started is stopped, even if one did not
            if start.exception() is None:
                stack.callback(start.result().stop)
        first, second = servers = [start.result() for start in starts]
        adapter = AdapterServer(
            triton_url=f"{first.grpc_url},{second.grpc_url}",
            port=0,
            served_model_name=MODEL,
            log_path=tmp_path / "adapter.log",
        )
        stack.enter_context(adapter)
        client = stack.enter_context(httpx.Client(base_url=adapter.url, timeout=60))

        before = [finished_requests(s) for s in servers]
        for _ in range(REQUESTS):
            complete(client)

        def grown() -> list[float]:
            return [finished_requests(s) - b for s, b in zip(servers, before, strict=True)]

        # The engines publish their counters a moment after the responses.
        assert wait_for(lambda: sum(grown()) == REQUESTS), grown()
        assert min(grown()) > 0, grown()  # both served some

        second.stop()
        before_first = finished_requests(first)
        for _ in range(REQUESTS):  # the first one to reach the stopped Triton fails over
            complete(client)
        assert wait_for(lambda: finished_requests(first) - before_first == REQUESTS)
        assert client.get("/health/ready").status_code == 200
