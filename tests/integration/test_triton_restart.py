"""Triton killed mid-stream (kill -9 of its process group) under a running adapter: open streams
end with an error event and [DONE], /health/ready is 503 while Triton is down, and once a new
tritonserver is up on the same ports requests succeed again, the adapter never restarted.

Its own tritonserver on fixed free ports, not the session's: this one dies. Its `llm` is the
session's gated one, so that the streams are held open until the kill."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backend.adapter_server import AdapterServer
from backend.processes import free_ports
from backend.repository import write_repository
from backend.tritonserver import SHM_DIR, TritonServer
from tests.conftest import GATED_LLM
from tests.integration.openai_support import MODEL, held, sse_events, wait_for

STREAMS = 3
PARAMETERS = {"max_model_len": "512", "max_num_seqs": "4"}
LONG = {"model": MODEL, "prompt": "Hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
RECONNECT_BOUND_S = 10.0  # measured ~1 s with the adapter's reconnect backoff (10 s without)


@pytest.fixture
def own_triton(model_dir: Path, tmp_path: Path) -> Iterator[tuple[Path, tuple[int, int, int]]]:
    """(repository, fixed ports) for tritonservers started by the test itself."""
    http, grpc, metrics = free_ports(3)
    repository = write_repository(tmp_path / "model_repository", model_dir, PARAMETERS)
    shutil.copy(GATED_LLM, repository / "llm" / "1" / "model.py")
    yield repository, (http, grpc, metrics)


@pytest.mark.timeout(600)
def test_triton_killed_mid_stream_then_back(own_triton, tmp_path: Path) -> None:
    repository, ports = own_triton
    with contextlib.ExitStack() as stack:
        first = TritonServer(repository, *ports, log_path=tmp_path / "triton-1.log").start_ready(
            240
        )
        stack.callback(first.stop)
        adapter = AdapterServer(
            first.grpc_url, port=0, served_model_name=MODEL, log_path=tmp_path / "adapter.log"
        )
        stack.enter_context(adapter)
        adapter_pid = adapter.pid
        client = stack.enter_context(httpx.Client(base_url=adapter.url, timeout=60))

        with held(first):  # each stream gets its first token, then none until the kill
            streams = [
                stack.enter_context(client.stream("POST", "/v1/completions", json=LONG))
                for _ in range(STREAMS)
            ]
            lines = [stream.iter_lines() for stream in streams]
            for stream, stream_lines in zip(streams, lines, strict=True):
                assert stream.status_code == 200
                assert next(line for line in stream_lines if line.startswith("data: "))
            killed_at = time.monotonic()
            os.killpg(first.pid, signal.SIGKILL)  # tritonserver and its backend stubs at once

        for stream_lines in lines:  # each ends at once with an error event, then [DONE]
            *_, error, done = sse_events(list(stream_lines))
            assert done == "[DONE]"
            assert error["error"]["type"] == "server_error", error
        ended_in = time.monotonic() - killed_at
        assert ended_in < 10, ended_in

        assert client.get("/health/ready").status_code == 503
        refused = client.post("/v1/completions", json={**LONG, "stream": False, "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "service_unavailable"
        first.stop()

        second = TritonServer(repository, *ports, log_path=tmp_path / "triton-2.log").start_ready(
            240
        )
        stack.callback(second.stop)
        back_at = time.monotonic()
        assert wait_for(
            lambda: client.get("/health/ready").status_code == 200, timeout_s=RECONNECT_BOUND_S
        ), adapter.log_tail()
        reconnected_in = time.monotonic() - back_at
        reply = client.post("/v1/completions", json={**LONG, "stream": False, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        with client.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 4}) as stream:
            events = sse_events(list(stream.iter_lines()))
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert adapter.pid == adapter_pid and adapter.running  # the same adapter process
        print(
            f"\ntriton kill -9: {STREAMS} open streams ended in {ended_in:.2f} s with an error "
            f"event and [DONE]; adapter ready {reconnected_in:.2f} s after Triton was back"
        )


@pytest.mark.timeout(300)
def test_a_server_that_fails_after_loading_its_models_leaves_no_shared_memory(
    own_triton, tmp_path: Path
) -> None:
    """Its gRPC port held by another socket: tritonserver loads the models (their stubs create
    their regions), fails to bind, and exits, leaving the regions in /dev/shm, which in a pod
    outlive a crash-looping container (an audit). Those seen while it started are removed."""
    repository, (http, grpc, metrics) = own_triton
    server = TritonServer(repository, http, grpc, metrics, log_path=tmp_path / "triton.log")
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port is in TIME_WAIT
        other.bind(("127.0.0.1", grpc))
        other.listen()
        server.start()
        try:
            with pytest.raises(RuntimeError, match="tritonserver exited"):
                server.wait_ready(240)
        finally:
            regions = set(server.shm_regions)
            server.stop()
    assert "already in use" in server.log_path.read_text()
    assert regions, "no stub was seen while the server started"
    assert not [region for region in regions if (SHM_DIR / region).exists()]
