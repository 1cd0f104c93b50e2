"""The response writer with a fake transport: one response per token while it keeps up, merged
responses for a slow consumer, order, one FINAL under errors and cancellation, the cap, stats,
and the stream interval in time and in tokens (several streams wait between responses, a lone
one and ends do not)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from backend import response_writer
from backend.outputs import CANCELLED, PromptLogprobs, StepOutput, merge_outputs
from backend.response_writer import Outbox, ResponseWriter
from tests.integration.openai_support import wait_for

WAIT_S = 60.0
PROMPT = PromptLogprobs(
    ids=[1, 2, 3],
    token_bytes=[b"a", b"b", b"c"],
    logprobs=np.zeros(2, np.float32),
    top_ids=np.zeros((2, 0), np.int32),
    top_logprobs=np.zeros((2, 0), np.float32),
    top_bytes=[],
    token_id_logprobs=np.zeros((2, 0), np.float32),
    token_id_bytes=[],
)


def step(i: int, *, final: bool = False, first: bool = False) -> StepOutput:
    """Token i: id i, text "t{i}", logprob -i, top-1 (i + 100), explicit ids 7 and 8."""
    return StepOutput(
        token_ids=[i],
        text=f"t{i}",
        token_bytes=[f"t{i}".encode()],
        logprobs=np.array([-i], np.float32),
        top_ids=np.array([[i + 100]], np.int32),
        top_logprobs=np.array([[-0.5 * i]], np.float32),
        top_bytes=[b"top"],
        token_id_logprobs=np.array([[-7.0 - i, -8.0 - i]], np.float32),
        token_id_bytes=[b"7", b"8"] if first else [],
        finish_reason="length" if final else None,
        prompt_tokens=3,
        completion_tokens=i,
        prompt=PROMPT if first else None,
    )


class FakeTransport:
    """Records (request, output, final) and errors; `gate`, when set, holds every send until
    it opens; `cancelled` is what Triton would answer."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, StepOutput | str, bool]] = []
        self.sent_at: list[float] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Semaphore(0)
        self.changed = threading.Condition()
        self.cancelled: set[str] = set()
        self.checked: collections.Counter[str] = collections.Counter()

    def _record(self, item: tuple[str, StepOutput | str, bool]) -> None:
        self.entered.release()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        with self.changed:
            self.sent.append(item)
            self.sent_at.append(time.monotonic())
            self.changed.notify_all()

    def send(self, request: str, output: StepOutput, final: bool) -> None:
        self._record((request, output, final))

    def send_error(self, request: str, message: str, kind: str) -> None:
        self._record((request, f"{kind}: {message}", True))

    def is_cancelled(self, request: str) -> bool:
        self.checked[request] += 1
        return request in self.cancelled

    def wait_for(self, count: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.sent) >= count, WAIT_S), self.sent


@pytest.fixture
def transport() -> FakeTransport:
    return FakeTransport()


@pytest.fixture
def writer(transport: FakeTransport) -> Iterator[ResponseWriter[str, int]]:
    writer: ResponseWriter[str, int] = ResponseWriter(transport)
    writer.start()
    yield writer
    writer.stop()


def test_a_writer_that_keeps_up_sends_one_response_per_token(
    writer: ResponseWriter[str, int], transport: FakeTransport
) -> None:
    box = writer.outbox("r")
    for i in range(1, 4):
        box.send(step(i, final=i == 3, first=i == 1))
        transport.wait_for(i)  # sent before the next token exists: nothing waits to merge
    sent = [(getattr(out, "token_ids", out), final) for _, out, final in transport.sent]
    assert sent == [([1], False), ([2], False), ([3], True)]


def test_a_slow_consumer_gets_fewer_responses_with_the_same_tokens(
    writer: ResponseWriter[str, int], transport: FakeTransport
) -> None:
    transport.gate = threading.Event()
    box = writer.outbox("r")
    outputs = [step(i, final=i == 6, first=i == 1) for i in range(1, 7)]
    box.send(outputs[0])
    assert transport.entered.acquire(timeout=WAIT_S)  # the first send is in progress, held
    for out in outputs[1:]:
        box.send(out)  # the engine runs ahead of the writer
    transport.gate.set()
    transport.wait_for(2)
    writer.stop()
    [(_, first, first_final), (_, rest, rest_final)] = transport.sent
    assert isinstance(first, StepOutput) and isinstance(rest, StepOutput)
    assert (first.token_ids, first_final) == ([1], False)
    assert (rest.token_ids, rest_final) == ([2, 3, 4, 5, 6], True)
    assert rest.text == "t2t3t4t5t6" and rest.finish_reason == "length"
    assert rest.completion_tokens == 6 and rest.token_id_bytes == [] and rest.prompt is None
    expected = merge_outputs(outputs[1:])
    for name in ("logprobs", "top_ids", "top_logprobs", "token_id_logprobs"):
        assert np.array_equal(getattr(rest, name), getattr(expected, name)), name
    assert rest.token_id_logprobs.shape == (5, 2) and rest.top_ids.shape == (5, 1)
    assert writer.responses_sent == 2 and writer.tokens_sent == 6


def test_merge_keeps_the_first_responses_once_only_fields() -> None:
    merged = merge_outputs([step(1, first=True), step(2), step(3, final=True)])
    assert merged.token_ids == [1, 2, 3] and merged.text == "t1t2t3"
    assert merged.token_bytes == [b"t1", b"t2", b"t3"] and merged.top_bytes == [b"top"] * 3
    assert merged.logprobs.tolist() == [-1, -2, -3]
    assert merged.token_id_bytes == [b"7", b"8"]
    assert merged.prompt is not None and merged.prompt.ids == [1, 2, 3]
    assert (merged.finish_reason, merged.completion_tokens) == ("length", 3)


def test_data_then_an_error_is_one_final_and_nothing_after_it(
    writer: ResponseWriter[str, int], transport: FakeTransport
) -> None:
    transport.gate = threading.Event()
    box = writer.outbox("r")
    box.send(step(1, first=True))
    assert transport.entered.acquire(timeout=WAIT_S)
    box.send(step(2))
    box.send_error("the request was cancelled", kind=CANCELLED)
    box.send(step(3, final=True))  # after the end: dropped
    transport.gate.set()
    writer.stop()
    sent = [(getattr(out, "token_ids", out), final) for _, out, final in transport.sent]
    assert sent == [([1], False), ([2], False), ("cancelled: the request was cancelled", True)]


def test_requests_keep_their_own_order(
    writer: ResponseWriter[str, int], transport: FakeTransport
) -> None:
    boxes = {name: writer.outbox(name) for name in "abc"}
    for i in range(1, 6):
        for box in boxes.values():
            box.send(step(i, final=i == 5))
    writer.stop()
    for name in "abc":
        mine = [(out, final) for r, out, final in transport.sent if r == name]
        tokens = [t for out, _ in mine for t in getattr(out, "token_ids", [])]
        assert tokens == [1, 2, 3, 4, 5]
        assert [final for _, final in mine] == [False] * (len(mine) - 1) + [True]


def test_the_cap_splits_what_piled_up(transport: FakeTransport) -> None:
    writer: ResponseWriter[str, int] = ResponseWriter(transport, max_tokens_per_response=2)
    writer.start()
    transport.gate = threading.Event()
    box = writer.outbox("r")
    box.send(step(1))
    assert transport.entered.acquire(timeout=WAIT_S)
    for i in range(2, 7):
        box.send(step(i, final=i == 6))
    transport.gate.set()
    writer.stop()
    sizes = [getattr(out, "token_ids", out) for _, out, _ in transport.sent]
    assert sizes == [[1], [2, 3], [4, 5], [6]]
    assert [final for _, _, final in transport.sent] == [False, False, False, True]


def test_cancellation_is_read_from_triton_on_the_writer_thread(
    writer: ResponseWriter[str, int], transport: FakeTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(response_writer, "CANCEL_CHECK_INTERVAL_S", 0.0)
    monkeypatch.setattr(response_writer, "UNANSWERED_CANCEL_CHECK_INTERVAL_S", 3600.0)
    box = writer.outbox("r")
    box.send(step(1))
    transport.wait_for(1)
    assert not box.is_cancelled() and transport.checked == {"r": 1}
    transport.cancelled.add("r")
    box.send(step(2))
    transport.wait_for(2)
    assert box.is_cancelled()  # the engine's next step reads this flag: no IPC of its own


def test_a_request_without_a_response_is_asked_about_cancellation(
    writer: ResponseWriter[str, int], transport: FakeTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One still waiting for a slot in the engine: the writer asks Triton about it too, so
    that the engine can drop it before its prefill, and stops asking once it is cancelled."""
    monkeypatch.setattr(response_writer, "UNANSWERED_CANCEL_CHECK_INTERVAL_S", 0.01)
    transport.cancelled.add("q")
    box = writer.outbox("q")
    assert wait_for(box.is_cancelled)
    answered = writer.outbox("a")
    assert wait_for(lambda: transport.checked["a"] >= 2)  # two sweeps since "q" was cancelled
    assert transport.checked["q"] == 1
    answered.send(step(1, final=True))
    transport.wait_for(1)
    assert _responses(transport) == [("a", [1], True)]


def test_cancel_flags_the_matching_requests_that_have_not_ended(
    writer: ResponseWriter[str, int], transport: FakeTransport
) -> None:
    """A CANCEL request's way in: no question to Triton, and a request that ended is not
    counted (its FINAL went; the CANCEL crossed it)."""
    waiting, streaming, other, ended = (writer.outbox(name) for name in ("a1", "a2", "b", "a3"))
    streaming.send(step(1))
    ended.send(step(1, final=True))
    transport.wait_for(2)
    assert wait_for(lambda: ended.closed)
    assert writer.cancel(lambda request: request.startswith("a")) == 2
    assert waiting.is_cancelled() and streaming.is_cancelled()
    assert not other.is_cancelled() and not ended.is_cancelled()
    assert writer.cancel(lambda request: request == "a3") == 0


def test_the_latest_stats_reach_the_metrics_and_stop_flushes_them(
    transport: FakeTransport,
) -> None:
    published: list[int] = []
    writer: ResponseWriter[str, int] = ResponseWriter(transport, on_stats=published.append)
    writer.start()
    for value in range(1, 50):
        writer.publish_stats(value)
    writer.stop()
    assert published and published[-1] == 49
    assert published == sorted(published)  # snapshots in order, stale ones skipped


def _responses(transport: FakeTransport) -> list[tuple[str, list[int] | str, bool]]:
    return [(r, getattr(out, "token_ids", out), final) for r, out, final in transport.sent]


@pytest.fixture
def patient_writer(transport: FakeTransport) -> Iterator[ResponseWriter[str, int]]:
    """A stream interval far longer than any test, in time and in tokens: what goes out did not
    wait for it."""
    writer: ResponseWriter[str, int] = ResponseWriter(
        transport, stream_interval_s=3600, stream_interval_tokens=1000
    )
    writer.start()
    yield writer
    writer.stop()


def test_several_streams_wait_their_interval_but_not_for_their_end(
    patient_writer: ResponseWriter[str, int], transport: FakeTransport
) -> None:
    a, b = patient_writer.outbox("a"), patient_writer.outbox("b")
    a.send(step(1, first=True))
    b.send(step(1, first=True))
    transport.wait_for(2)  # first tokens go at once
    a.send(step(2))
    a.send(step(3))
    b.send(step(2))
    a.send(step(4, final=True))  # the end goes at once, with what waited
    transport.wait_for(3)
    assert _responses(transport)[2] == ("a", [2, 3, 4], True)
    b.send_error("the request was cancelled", kind=CANCELLED)
    transport.wait_for(5)
    assert _responses(transport)[3:] == [
        ("b", [2], False),
        ("b", "cancelled: the request was cancelled", True),
    ]
    assert patient_writer.responses_sent == 4 and patient_writer.tokens_sent == 6


def test_a_lone_stream_never_waits(
    patient_writer: ResponseWriter[str, int], transport: FakeTransport
) -> None:
    box = patient_writer.outbox("r")
    for i in range(1, 4):
        box.send(step(i, final=i == 3, first=i == 1))
        transport.wait_for(i)
    assert _responses(transport) == [("r", [1], False), ("r", [2], False), ("r", [3], True)]


def test_a_waiting_response_goes_when_its_interval_is_over(transport: FakeTransport) -> None:
    """Tokens 2 and 3 of a are pending before the writer looks at a again (it is held in a's
    first send meanwhile), so they go as one response however slow the test thread is; that
    response then waits for the interval after a's first."""
    interval = 0.05
    writer: ResponseWriter[str, int] = ResponseWriter(transport, stream_interval_s=interval)
    transport.gate = threading.Event()
    writer.start()
    try:
        a, b = writer.outbox("a"), writer.outbox("b")
        a.send(step(1, first=True))
        b.send(step(1, first=True))
        assert transport.entered.acquire(timeout=WAIT_S)  # the writer is in a's first send
        a.send(step(2))
        a.send(step(3))
        transport.gate.set()
        transport.wait_for(3)
        assert _responses(transport)[2] == ("a", [2, 3], False)
        first_of_a = transport.sent_at[[r for r, _, _ in transport.sent].index("a")]
        assert transport.sent_at[2] - first_of_a >= interval
    finally:
        writer.stop()


def _two_streams(
    writer: ResponseWriter[str, int], transport: FakeTransport
) -> tuple[Outbox[str], Outbox[str]]:
    """Streams a and b, their first tokens sent: from now on each may wait."""
    a, b = writer.outbox("a"), writer.outbox("b")
    a.send(step(1, first=True))
    b.send(step(1, first=True))
    transport.wait_for(2)
    return a, b


def _started_behind(writer: ResponseWriter[str, int], transport: FakeTransport, name: str) -> None:
    """A new stream's first token: once it is out, the writer has handled what was queued
    before it (one queue, in order)."""
    writer.outbox(name).send(step(1, first=True))
    transport.wait_for(len(transport.sent) + 1)
    assert _responses(transport)[-1] == (name, [1], False)


def test_several_streams_wait_for_their_interval_in_tokens_but_not_for_their_end(
    transport: FakeTransport,
) -> None:
    writer: ResponseWriter[str, int] = ResponseWriter(transport, stream_interval_tokens=3)
    writer.start()
    try:
        a, _ = _two_streams(writer, transport)  # first tokens go at once
        a.send(step(2))
        a.send(step(3))
        _started_behind(writer, transport, "c")  # a's two tokens were seen, and held
        a.send(step(4))  # the third goes, with the two
        transport.wait_for(4)
        assert _responses(transport)[3] == ("a", [2, 3, 4], False)
        a.send(step(5))
        a.send(step(6, final=True))  # the end goes at once, with what waited
        transport.wait_for(5)
        assert _responses(transport)[4] == ("a", [5, 6], True)
    finally:
        writer.stop()


@pytest.mark.parametrize(
    "interval", [{"stream_interval_s": 3600}, {"stream_interval_tokens": 3}], ids=["time", "tokens"]
)
def test_stop_sends_what_waits(transport: FakeTransport, interval: dict[str, Any]) -> None:
    writer: ResponseWriter[str, int] = ResponseWriter(transport, **interval)
    writer.start()
    a, _ = _two_streams(writer, transport)
    a.send(step(2))
    _started_behind(writer, transport, "c")  # a's token was seen, and held
    writer.stop()
    assert _responses(transport)[3:] == [("a", [2], False)]


def test_a_cap_below_the_token_floor_lowers_the_floor(transport: FakeTransport) -> None:
    writer: ResponseWriter[str, int] = ResponseWriter(
        transport, max_tokens_per_response=1, stream_interval_tokens=3
    )
    writer.start()
    try:
        a, _ = _two_streams(writer, transport)
        a.send(step(2))  # one token is all a response may carry: it goes without waiting
        transport.wait_for(3)
        assert _responses(transport)[2] == ("a", [2], False)
    finally:
        writer.stop()
