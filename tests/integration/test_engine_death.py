"""A backend stub killed (kill -9, as an out-of-memory kill or a crash in torch would) under the
launcher's supervisor, with the adapter in front: the stream in flight ends with an error event,
the adapter turns not-ready, requests in the outage get 503 with Retry-After, and tritonserver
comes back by itself, serving the same greedy text and counting the restart.

The supervisor runs in a thread of the test (its restart policy made quick), on its own
tritonserver and adapter: these die and come back, the session's must not.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from backend import contract
from backend.adapter_server import AdapterServer
from backend.engine_process import engine_of
from backend.repository import write_repository
from backend.supervisor import RestartPolicy, Supervisor
from backend.tritonserver import SHM_DIR, TritonServer, running
from tests.conftest import GATED_LLM
from tests.integration.openai_support import MODEL, held, sse_events, wait_for
from tests.integration.proc import resident_kib
from tests.streaming import Streamer

# engine_hang_timeout_s: generous, as a false hang would restart the stack (a first forward on a
# GPU compiles the logprob kernel while the engine is silent)
HANG_TIMEOUT_S = 30
PARAMETERS = {
    "max_model_len": "512",
    "max_num_seqs": "4",
    "engine_hang_timeout_s": str(HANG_TIMEOUT_S),
}
QUICK = RestartPolicy(max_restarts=20, backoff_s=0.2, max_backoff_s=0.2, poll_interval_s=0.2)
FAIL_FAST_S = 5.0  # the bound on the stream's error and on /health/ready turning 503
# Only ends the wait for a heal that never comes: a restart is a model load, whose time depends on
# the machine (measured 11-28 s; the goal of 60 s is reported in bench/RESULTS.md).
HEAL_BOUND_S = 240.0
LONG = {"model": MODEL, "prompt": "Hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
LONG_IDS = {
    contract.INPUT_IDS: np.array([1, 2, 3], dtype=np.int32),
    contract.MAX_TOKENS: np.array([500], dtype=np.int32),
    contract.IGNORE_EOS: np.array([True]),
}
# Greedy: the API's default temperature is 1, which samples a different text about 2% of the
# time, even from this memorised passage.
GREEDY = {"model": MODEL, "prompt": "Triton serves the model", "max_tokens": 8, "temperature": 0}
CRASH_AT_RELOAD = Path(__file__).with_name("crashing_llm.py")


@dataclass
class Stack:
    """A supervised tritonserver and adapter, and an HTTP client to the adapter."""

    server: TritonServer
    adapter: AdapterServer
    supervisor: Supervisor
    thread: threading.Thread
    http: httpx.Client
    exit_code: list[int] = field(default_factory=list)

    def stub_pid(self, model: str) -> int:
        return next(stub.process.pid for stub in self.server.stubs if stub.model == model)

    def victim(self, model: str) -> int:
        """The process a test kills for `model` (see its test)."""
        if model == "tritonserver":
            assert self.server.pid is not None
            return self.server.pid
        if model == "engine":
            return engine_of(self.stub_pid("llm")).pid
        return self.stub_pid(model)

    def ready(self) -> bool:
        return self.http.get("/health/ready").status_code == 200

    def healed(self) -> bool:
        """Ready, and the supervisor has seen it so (it then knows the new server's stubs: the
        adapter may turn ready a poll before)."""
        return self.ready() and bool(self.server.stubs)

    def restarts_metric(self) -> int:
        text = httpx.get(self.server.metrics_url, timeout=5).text
        match = re.search(r'^llm_server_restarts_total\{model="llm"\} (\d+)', text, re.M)
        assert match, text[-2000:]
        return int(match.group(1))


def supervised(
    repository: Path, tmp_path: Path, policy: RestartPolicy = QUICK
) -> tuple[TritonServer, AdapterServer | None, Supervisor, threading.Thread, list[int]]:
    server = TritonServer(repository, 0, 0, 0, log_path=tmp_path / "tritonserver.log")
    adapter = AdapterServer(
        server.grpc_url, port=0, served_model_name=MODEL, log_path=tmp_path / "adapter.log"
    )
    stop = threading.Event()
    supervisor = Supervisor([server, adapter], stop, ready_timeout_s=240, policy=policy)
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(supervisor.run(lambda: None)))
    thread.start()
    return server, adapter, supervisor, thread, exit_code


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run = tmp_path_factory.mktemp("engine-death")
    repository = write_repository(run / "model_repository", model_dir, PARAMETERS)
    shutil.copy(GATED_LLM, repository / "llm" / "1" / "model.py")  # streams held at will
    server, adapter, supervisor, thread, exit_code = supervised(repository, run)
    try:
        with httpx.Client(base_url=adapter.url, timeout=60) as http:
            stack = Stack(server, adapter, supervisor, thread, http, exit_code)
            assert wait_for(lambda: adapter.running and _answers(stack), timeout_s=240)
            assert wait_for(stack.healed, timeout_s=240)
            yield stack
    finally:
        supervisor.stop.set()
        thread.join()
    assert exit_code == [0]


def _answers(stack: Stack) -> bool:
    try:
        return stack.ready()
    except httpx.TransportError:
        return False


def _completion(stack: Stack) -> str:
    reply = stack.http.post("/v1/completions", json=GREEDY)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["llm", "engine", "preprocessing", "tritonserver"])
def test_a_killed_stub_fails_fast_reports_not_ready_and_heals(stack: Stack, model: str) -> None:
    """`model` is the stub killed; "engine" kills the `llm` stub's engine process (the stub then
    ends itself); "tritonserver" kills the server process itself (its stubs are left orphaned,
    and must go too)."""
    before = _completion(stack)
    restarts = stack.restarts_metric()
    old_regions = {stub.shm_region for stub in stack.server.stubs}
    direct = Streamer(stack.server.grpc_url)  # a tritonclient caller, straight to `llm`
    # Held after their first token, the streams are still open whenever the fault lands.
    with held(stack.server), stack.http.stream("POST", "/v1/completions", json=LONG) as stream:
        direct.send("llm", LONG_IDS)
        lines = stream.iter_lines()
        assert stream.status_code == 200
        assert next(line for line in lines if line.startswith("data: "))
        assert direct.next()[1] is None  # streaming
        old_stubs = [stub.process for stub in stack.server.stubs]
        os.kill(stack.victim(model), signal.SIGKILL)
        killed_at = time.monotonic()
        *_, error, done = sse_events(list(lines))
        errored_in = time.monotonic() - killed_at
    assert done == "[DONE]"
    assert error["error"]["type"] == "server_error", error
    assert errored_in < FAIL_FAST_S, errored_in
    direct_error = direct.collect().error
    assert direct_error is not None and time.monotonic() - killed_at < FAIL_FAST_S
    direct.client.close()

    assert wait_for(lambda: stack.http.get("/health/ready").status_code == 503, FAIL_FAST_S)
    unready_in = time.monotonic() - killed_at
    refused = stack.http.post("/v1/completions", json=GREEDY)
    if refused.status_code == 503:  # still in the outage (it lasts the backoff and a reload)
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "service_unavailable"

    assert wait_for(stack.healed, HEAL_BOUND_S), stack.server.log_tail()
    healed_in = time.monotonic() - killed_at
    assert _completion(stack) == before
    assert stack.restarts_metric() == restarts + 1
    assert not any((SHM_DIR / region).exists() for region in old_regions if region)
    assert not [stub for stub in old_stubs if running(stub)]
    fault = {"tritonserver": model, "engine": "the engine process"}.get(model, f"the {model} stub")
    print(
        f"\nkill -9 of {fault}: stream error in {errored_in:.2f} s, adapter not ready in "
        f"{unready_in:.2f} s, healed in {healed_in:.1f} s"
    )


@pytest.mark.timeout(600)
def test_a_hung_engine_is_killed_and_the_stack_heals(stack: Stack) -> None:
    """Stopped (SIGSTOP), the engine process sends nothing, as a deadlocked one would, while
    every process stays alive: after `engine_hang_timeout_s` the stub kills it, and the stack
    heals as from a death."""
    before = _completion(stack)
    restarts = stack.restarts_metric()
    with held(stack.server), stack.http.stream("POST", "/v1/completions", json=LONG) as stream:
        lines = stream.iter_lines()
        assert stream.status_code == 200
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(stack.victim("engine"), signal.SIGSTOP)
        stopped_at = time.monotonic()
        *_, error, done = sse_events(list(lines))
        errored_in = time.monotonic() - stopped_at
    assert done == "[DONE]"
    assert error["error"]["type"] == "server_error", error
    # Its last report came at most one gated iteration (10 ms) before the stop.
    # After the timeout, one more second of grace (`_HANG_GRACE_S`), then the kill.
    assert HANG_TIMEOUT_S - 1 < errored_in < HANG_TIMEOUT_S + 1 + FAIL_FAST_S, errored_in
    assert wait_for(lambda: not stack.ready(), FAIL_FAST_S)  # the old server is going
    assert wait_for(stack.healed, HEAL_BOUND_S), stack.server.log_tail()
    assert _completion(stack) == before
    assert stack.restarts_metric() == restarts + 1
    assert stack.server.log_path is not None
    assert "it is hung; killing it" in stack.server.log_path.read_text(errors="replace")
    print(f"\na stopped engine: stream error in {errored_in:.2f} s")


@pytest.mark.timeout(900)
def test_five_crash_and_heal_cycles_lose_no_request_and_leak_nothing(stack: Stack) -> None:
    """A light load runs throughout: every request gets its text or a clear error, those sent
    while the stack is ready (between the cycles) all succeed, and nothing is left behind."""
    expected = _completion(stack)
    outcomes: list[str] = []
    done = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=stack.adapter.url, timeout=60) as http:
            while not done.is_set():
                reply = http.post("/v1/completions", json=GREEDY)
                if reply.status_code == 200:
                    text = reply.json()["choices"][0]["text"]
                    outcomes.append("ok" if text == expected else f"wrong text {text!r}")
                elif reply.json().get("error", {}).get("type") == "server_error":
                    outcomes.append(str(reply.status_code))
                else:
                    outcomes.append(f"not a server error: {reply.text}")

    loader = threading.Thread(target=load)
    loader.start()
    dead: list[psutil.Process] = []
    rss: list[int] = []
    try:
        for _ in range(5):
            assert all(_completion(stack) == expected for _ in range(3))  # ready: all succeed
            rss.append(resident_kib(stack.adapter.pid or 0))
            dead += [stub.process for stub in stack.server.stubs]
            dead.append(psutil.Process(stack.server.pid))
            os.kill(stack.stub_pid("llm"), signal.SIGKILL)
            assert wait_for(lambda: not stack.ready(), FAIL_FAST_S)
            assert wait_for(stack.healed, HEAL_BOUND_S), stack.server.log_tail()
        assert _completion(stack) == expected
    finally:
        done.set()
        loader.join()
    assert "ok" in outcomes and set(outcomes) <= {"ok", "503", "500"}, outcomes
    assert not [process for process in dead if running(process)]
    metrics = stack.http.get("/metrics").text
    assert re.search(r"^adapter_requests_in_flight 1\.0$", metrics, re.M), metrics  # this one
    # Flat: the first cycle's RSS includes warm-up; the others within 10 MiB of it.
    assert max(rss[1:]) - rss[0] < 10 * 1024, rss
    print(f"\n5 crash-and-heal cycles: outcomes {sorted(set(outcomes))}, adapter RSS KiB {rss}")


@pytest.mark.timeout(600)
def test_a_model_that_crashes_at_every_reload_makes_the_launcher_give_up(
    model_dir: Path, tmp_path: Path
) -> None:
    """Its first load works; after its stub is killed, every load crashes: the supervisor
    restarts it `max_restarts` times, then returns 1 (the launcher's exit code), leaving no
    process behind."""
    repository = write_repository(tmp_path / "model_repository", model_dir, PARAMETERS)
    shutil.copy(CRASH_AT_RELOAD, repository / "llm" / "1" / "model.py")
    policy = RestartPolicy(max_restarts=2, backoff_s=0.2, max_backoff_s=0.2, poll_interval_s=0.2)
    server, adapter, supervisor, thread, exit_code = supervised(repository, tmp_path, policy)
    try:
        assert wait_for(lambda: bool(server.stubs) and adapter is not None and adapter.running, 240)
        stub = next(stub for stub in server.stubs if stub.model == "llm")
        os.kill(stub.process.pid, signal.SIGKILL)
        thread.join(timeout=HEAL_BOUND_S * 3)  # only ends the wait for a supervisor that loops
    finally:
        supervisor.stop.set()
        thread.join()
    assert exit_code == [1]
    assert server.restarts == 2
    log = server.log_path.read_text() if server.log_path else ""
    assert log.count("crashing_llm: crashed at load") == 2
    assert not server.running and not (adapter and adapter.running)
