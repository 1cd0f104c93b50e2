"""The engine in a process of its own (`backend.engine_process`): outputs reach their sinks as
the model computes them, a sink's cancel reaches the engine, `stop` ends every request, and the
engine's death fails every request in flight, as the stub's death ends the engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import pytest
from transformers import AutoConfig

from backend.config import LLMConfig
from backend.engine import Engine, EngineStats
from backend.engine_process import EngineProcess, build_engine
from backend.outputs import BUSY, CANCELLED, INTERNAL
from backend.params import GenerationParams
from backend.stopping import LENGTH
from backend.structured_output import CHOICE, StructuredOutput
from tests.reference import reference_greedy, reference_logprobs
from tests.sinks import RecordingSink

WAIT_S = 60.0
ATOL = 1e-4
IDS = [0, 7, 1003, 7]  # a duplicate too


@pytest.fixture
def config(model_dir: Path) -> LLMConfig:
    return LLMConfig(model_path=str(model_dir), max_num_seqs=4, max_model_len=512, num_threads=1)


@pytest.fixture
def engine(config: LLMConfig) -> Iterator[EngineProcess]:
    process = EngineProcess(config)
    process.start()
    yield process
    process.stop()


def long_request(prompt: list[int]) -> GenerationParams:
    """More tokens than a test waits for: it ends by cancel, stop or death."""
    return GenerationParams(prompt_ids=prompt, max_tokens=400, temperature=0, ignore_eos=True)


def wait_for_tokens(sink: RecordingSink) -> None:
    streaming = threading.Event()
    original = sink.send

    def send(output):  # type: ignore[no-untyped-def]
        original(output)
        streaming.set()

    sink.send = send  # type: ignore[method-assign]
    assert streaming.wait(WAIT_S)


def test_outputs_match_transformers_and_stats_arrive(
    config: LLMConfig, model_dir: Path, passage: list[int]
) -> None:
    stats: list[EngineStats] = []
    process = EngineProcess(config, on_stats=stats.append)
    ready = process.start()
    assert ready.limits.vocab_size == AutoConfig.from_pretrained(model_dir).vocab_size
    assert str(model_dir) in ready.description
    prompts = [passage[:5], passage[:12], [1, 2, 3]]
    sinks = [RecordingSink() for _ in prompts]
    try:
        for i, (prompt, sink) in enumerate(zip(prompts, sinks, strict=True)):
            process.submit(
                GenerationParams(
                    prompt_ids=prompt,
                    max_tokens=6,
                    temperature=0,
                    ignore_eos=True,
                    logprob_token_ids=IDS,
                    request_id=f"r{i}",
                ),
                sink,
            )
        for sink in sinks:
            assert sink.done.wait(WAIT_S)
    finally:
        process.stop()

    for prompt, sink in zip(prompts, sinks, strict=True):
        assert sink.error is None and sink.outputs[-1].finish_reason == LENGTH
        assert sink.token_ids == reference_greedy(model_dir, prompt, 6)
        expected = reference_logprobs(model_dir, prompt, sink.token_ids)[:, IDS]
        np.testing.assert_allclose(sink.id_logprobs, expected, atol=ATOL)
    assert stats[-1].finished_requests == len(prompts)
    assert stats[-1].active_sequences == 0


def test_the_engine_process_holds_no_named_semaphore(engine: EngineProcess) -> None:
    """Nothing in /dev/shm that a SIGKILL of the stub's group would leave behind: tqdm's
    default multiprocessing lock was one, created as the model loaded."""
    assert engine.pid is not None
    maps = Path(f"/proc/{engine.pid}/maps").read_text()
    assert "/dev/shm/" not in maps


def test_a_cancel_that_crosses_its_final_output_leaves_no_mark() -> None:
    """The stub forwards a client's cancel while the request's final output is on the pipe: the
    engine process drops it, where its set of cancelled keys grew by one each time."""
    from backend.engine_process import _Outgoing, _RemoteSink

    outgoing = _Outgoing(conn=None)  # type: ignore[arg-type]  # nothing is flushed here
    finished, running = _RemoteSink(1, outgoing), _RemoteSink(2, outgoing)
    outgoing.open(1)
    outgoing.open(2)
    finished.send_error("the request was cancelled", kind=CANCELLED)
    outgoing.cancel(1)
    outgoing.cancel(2)
    assert (finished.is_cancelled(), running.is_cancelled()) == (False, True)
    running.send_error("the request was cancelled", kind=CANCELLED)
    assert outgoing.cancelled == set()


def test_a_cancelled_request_ends_cancelled_and_the_others_finish(
    engine: EngineProcess, passage: list[int]
) -> None:
    cancelled, other = RecordingSink(cancel_after=2), RecordingSink()
    engine.submit(long_request(passage[:8]), cancelled)
    engine.submit(GenerationParams(prompt_ids=passage[:8], max_tokens=20, temperature=0), other)
    assert cancelled.done.wait(WAIT_S) and other.done.wait(WAIT_S)
    assert cancelled.kind == CANCELLED and "cancelled" in (cancelled.error or "")
    assert 2 <= len(cancelled.token_ids) < 400
    assert other.error is None and other.outputs[-1].finish_reason is not None


def test_a_request_that_fails_to_submit_fails_alone(
    engine: EngineProcess, passage: list[int]
) -> None:
    """A bug on the way in (a spec that no check refused, here one the grammar cache cannot
    hash) fails that request; the engine process goes on serving."""
    broken = object.__new__(StructuredOutput)
    for name, value in (("kind", CHOICE), ("value", {"yes": 1}), ("disable_any_whitespace", False)):
        object.__setattr__(broken, name, value)
    bad, other = RecordingSink(), RecordingSink()
    engine.submit(
        GenerationParams(prompt_ids=passage[:4], max_tokens=3, structured_output=broken), bad
    )
    engine.submit(GenerationParams(prompt_ids=passage[:8], max_tokens=3, temperature=0), other)
    assert bad.done.wait(WAIT_S) and other.done.wait(WAIT_S)
    assert bad.kind == INTERNAL and "TypeError" in (bad.error or "")
    assert other.error is None and len(other.token_ids) == 3


def test_stop_ends_requests_in_flight_and_the_process(
    config: LLMConfig, passage: list[int]
) -> None:
    process = EngineProcess(config)
    process.start()
    sink = RecordingSink()
    process.submit(long_request(passage[:8]), sink)
    wait_for_tokens(sink)
    process.stop()
    assert sink.done.is_set()
    assert sink.kind == BUSY and "shutting down" in (sink.error or "")
    assert len(sink.token_ids) < 400
    later = RecordingSink()
    process.submit(long_request(passage[:8]), later)
    assert later.done.is_set() and "shutting down" in (later.error or "")


def test_the_engine_process_death_fails_every_request_and_is_reported(
    config: LLMConfig, passage: list[int]
) -> None:
    died = threading.Event()
    process = EngineProcess(config, on_death=died.set)
    process.start()
    sinks = [RecordingSink(), RecordingSink()]
    for sink in sinks:
        process.submit(long_request(passage[:8]), sink)
    for sink in sinks:
        wait_for_tokens(sink)
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    assert died.wait(WAIT_S)
    for sink in sinks:
        assert sink.done.is_set() and sink.kind == BUSY  # UNAVAILABLE: the launcher restarts it
        assert sink.error == "the engine process died"
    process.stop()  # after a death: returns, and nothing more is sent


def test_a_hung_engine_process_is_killed_and_fails_every_request(
    config: LLMConfig, passage: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """Stopped (SIGSTOP), the engine sends nothing, as a deadlocked one would: after
    `engine_hang_timeout_s` the reader kills it, and its death takes the usual path."""
    died = threading.Event()
    process = EngineProcess(replace(config, engine_hang_timeout_s=1), on_death=died.set)
    process.start()
    sink = RecordingSink()
    process.submit(long_request(passage[:8]), sink)
    wait_for_tokens(sink)
    assert process.pid is not None
    engine = psutil.Process(process.pid)
    os.kill(process.pid, signal.SIGSTOP)
    assert died.wait(WAIT_S)
    assert sink.done.is_set() and sink.kind == BUSY and sink.error == "the engine process died"
    assert "it is hung; killing it" in caplog.text
    engine.wait(WAIT_S)  # killed, not left stopped
    process.stop()


def test_an_idle_engine_outlives_its_hang_timeout(config: LLMConfig, passage: list[int]) -> None:
    """Idle, it reports every 50 ms: three times `engine_hang_timeout_s` of its reports go by
    without a kill, and it still serves (a review: nothing checked a quiet engine was spared)."""
    died = threading.Event()
    reports: list[float] = []
    spanned = threading.Event()

    def on_stats(stats: EngineStats) -> None:
        reports.append(time.monotonic())
        if reports[-1] - reports[0] >= 3.0:
            spanned.set()

    process = EngineProcess(
        replace(config, engine_hang_timeout_s=1), on_stats=on_stats, on_death=died.set
    )
    process.start()
    try:
        assert spanned.wait(WAIT_S)
        assert not died.is_set()
        sink = RecordingSink()
        process.submit(GenerationParams(prompt_ids=passage[:8], max_tokens=3), sink)
        assert sink.done.wait(WAIT_S) and sink.error is None and len(sink.token_ids) == 3
    finally:
        process.stop()


def _slow_warm_up(engine: Engine) -> None:
    """In the engine process: a start that takes 3 s before its loop runs, as the CUDA kernels'
    first compile may (the scenario itself, not a wait for a condition)."""
    start = engine.start

    def slow_start() -> None:
        time.sleep(3.0)
        start()

    engine.start = slow_start  # type: ignore[method-assign]


def test_the_hang_clock_starts_with_the_engines_first_report(
    config: LLMConfig, passage: list[int]
) -> None:
    """Its warm-up runs after "ready", silent: longer than `engine_hang_timeout_s` is no hang
    (a review: the clock ran from "ready")."""
    died = threading.Event()
    process = EngineProcess(
        replace(config, engine_hang_timeout_s=1), on_death=died.set, prepare=_slow_warm_up
    )
    process.start()
    try:
        sink = RecordingSink()
        process.submit(GenerationParams(prompt_ids=passage[:8], max_tokens=3), sink)
        assert sink.done.wait(WAIT_S) and sink.error is None and len(sink.token_ids) == 3
        assert not died.is_set()
    finally:
        process.stop()


_ORPHAN = """
import sys
from backend.config import LLMConfig
from backend.engine_process import EngineProcess, build_engine
process = EngineProcess(LLMConfig(model_path=sys.argv[1], max_num_seqs=2, num_threads=1))
process.start()
print(process.pid, flush=True)
sys.stdin.read()
"""


def test_the_engine_process_ends_when_its_stub_is_killed(model_dir: Path) -> None:
    stub = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN, str(model_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stub.stdout is not None
        engine = psutil.Process(int(stub.stdout.readline()))
        assert engine.is_running()
    finally:
        stub.kill()
        stub.wait()
    engine.wait(WAIT_S)  # raises psutil.TimeoutExpired if the engine outlived its stub
    assert not engine.is_running()


def test_a_model_that_fails_to_load_fails_start_with_its_error(tmp_path: Path) -> None:
    process = EngineProcess(LLMConfig(model_path=str(tmp_path / "missing")))
    with pytest.raises(RuntimeError, match=r"the engine process failed to start: .*missing"):
        process.start()


def test_slots_a_small_kv_cache_leaves_out_wait_in_the_queue(model_dir: Path) -> None:
    """The adapter admits max_num_seqs + max_queue_size requests at once (from the config):
    with fewer slots than max_num_seqs, that many still fit, the rest waiting."""
    config = LLMConfig(
        model_path=str(model_dir), max_num_seqs=64, max_model_len=512, kv_cache_memory_mb=1
    )
    engine = build_engine(config, on_stats=None)
    assert 1 <= engine.runner.num_slots < 64
    assert engine.runner.num_slots + engine.max_queue_size == 64 + config.max_queue_size
