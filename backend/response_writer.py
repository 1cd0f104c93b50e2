"""One thread that sends the engine's outputs to Triton, so that the engine thread never waits on
a response, a cancellation check or a metric (docs/design.md, "Streaming responses").

The engine appends each step's output to the request's `Outbox` and goes on. The writer sends
everything pending for a request as one response, up to `max_tokens_per_response`. A first
token, a last one and an error go out at once. While several requests stream, a request's
next response waits until `stream_interval_s` after its previous one and until it holds
`stream_interval_tokens` tokens, so that it carries the tokens of several steps however long a
step takes: each response costs the stub's one core tensors and an IPC round trip that the
engine's steps would otherwise wait for. A lone stream never waits. One thread, so a request's
responses keep their order; FINAL goes with its last response, exactly once.

It knows nothing of pb_utils: a `Transport` (model.py's wraps Triton's response sender) sends.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from backend.outputs import INTERNAL, FinalError, StepOutput, merge_outputs

logger = logging.getLogger(__name__)

Request = TypeVar("Request")
RequestIn = TypeVar("RequestIn", contravariant=True)
Stats = TypeVar("Stats")

# Asking Triton whether a request was cancelled is an IPC round trip: at most this often per
# request, on the writer thread. A cancelled request stops within a few steps.
CANCEL_CHECK_INTERVAL_S = 0.02
# A request with no response yet (waiting for a slot in the engine, or in its prefill) is asked
# about too, less often: many may wait at once, and one whose client left should never start.
UNANSWERED_CANCEL_CHECK_INTERVAL_S = 0.25
# Each changed metric is an IPC round trip too: the latest stats go out at most this often (the
# engine publishes them every iteration, idle ones included, so the last snapshot follows).
STATS_INTERVAL_S = 0.05


class Transport(Protocol[RequestIn]):
    """How responses reach the client of a `Request` (in model.py, Triton's response sender)."""

    def send(self, request: RequestIn, output: StepOutput, final: bool) -> None: ...

    def send_error(self, request: RequestIn, message: str, kind: str) -> None:
        """The final response, as an error of `kind` (see `backend.engine`)."""

    def is_cancelled(self, request: RequestIn) -> bool: ...


class Outbox(Generic[Request]):
    """One request's outputs on their way out; the engine's sink for that request.

    `send` and `send_error` only append (engine thread), and queue the outbox for the writer
    unless it is queued already or waits for more tokens (`wait_for_tokens`); `is_cancelled`
    reads a flag the writer sets from Triton's answer, so the engine may ask every step for free.
    """

    def __init__(self, request: Request, ready: queue.SimpleQueue[object]) -> None:
        self.request = request
        self._ready = ready
        self._lock = threading.Lock()
        self._pending: list[StepOutput | FinalError] = []
        self._tokens = 0
        """Tokens in `_pending`."""
        self._wake_at = 1
        """Pending tokens at which a `send` queues the outbox (`wait_for_tokens`)."""
        self._queued = False
        self.ending = False
        """Its last output or its error is pending: it goes out now, whatever the interval."""
        self.cancelled = False
        # Writer thread only:
        self.closed = False
        """FINAL was sent."""
        self.sent_at: float | None = None
        """When its last data response went; None before the first."""
        self.waiting = False
        """It waits for its stream interval (it is in the writer's heap)."""
        self.checked_at = time.monotonic()
        """When Triton was last asked whether the request was cancelled."""

    def send(self, output: StepOutput) -> None:
        self._put(output)

    def send_error(self, message: str, *, kind: str = INTERNAL) -> None:
        self._put(FinalError(message, kind))

    def is_cancelled(self) -> bool:
        return self.cancelled

    def _put(self, item: StepOutput | FinalError) -> None:
        ends = isinstance(item, FinalError) or item.finish_reason is not None
        with self._lock:
            self._pending.append(item)
            self._tokens += 0 if isinstance(item, FinalError) else len(item.token_ids)
            # A waiting outbox is queued already, but its end must not wait: queue it again.
            wake = ends or (not self._queued and self._tokens >= self._wake_at)
            self._queued = self._queued or wake
            self.ending = self.ending or ends
        if wake:
            self._ready.put(self)

    def wait_for_tokens(self, count: int) -> bool:
        """Writer thread: True if fewer than `count` tokens are pending and the outbox does not
        end; then it leaves the writer's hands until the `send` that brings the count."""
        with self._lock:
            if self.ending or self._tokens >= count:
                return False
            self._wake_at = count
            self._queued = False
            return True

    def take(self) -> list[StepOutput | FinalError]:
        """Everything pending, in order (writer thread)."""
        with self._lock:
            items, self._pending = self._pending, []
            self._tokens = 0
            self._wake_at = 1
            self._queued = False
        return items


_STOP = object()
_STATS = object()
_SWEEP = object()


class ResponseWriter(Generic[Request, Stats]):
    """The writer thread of one model instance. `publish_stats` hands it the engine's latest
    stats snapshot, which it passes to `on_stats` (Triton's metrics API) when it has time."""

    def __init__(
        self,
        transport: Transport[Request],
        *,
        max_tokens_per_response: int = 0,
        stream_interval_s: float = 0.0,
        stream_interval_tokens: int = 1,
        on_stats: Callable[[Stats], None] | None = None,
    ) -> None:
        """`max_tokens_per_response` 0: no cap. `stream_interval_s` 0 and
        `stream_interval_tokens` 1: no request waits."""
        self._transport = transport
        self._cap = max_tokens_per_response
        self._interval = stream_interval_s
        # A cap below the floor wins: a response never waits for more tokens than it may carry.
        self._interval_tokens = min(stream_interval_tokens, self._cap or stream_interval_tokens)
        self._waiting: list[tuple[float, int, Outbox[Request]]] = []  # (due, order, outbox) heap
        self._short: set[Outbox[Request]] = set()
        """Outboxes past their interval that wait for tokens (the engine queues them again)."""
        self._order = itertools.count()
        self._streams = 0
        """Requests that got their first response and not their last."""
        self._stopping = False
        self._on_stats = on_stats
        self._ready: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._stats: Stats | None = None
        self._stats_queued = False
        self._stats_lock = threading.Lock()
        self._stats_sent_at = 0.0
        self._unanswered: set[Outbox[Request]] = set()
        """Outboxes that have had no response yet (`_sweep` asks Triton about them)."""
        self._unanswered_lock = threading.Lock()
        self._open: set[Outbox[Request]] = set()
        """Outboxes whose FINAL has not gone out (`cancel` looks among them)."""
        self._open_lock = threading.Lock()
        self._swept_at = time.monotonic()
        self._thread: threading.Thread | None = None
        self.responses_sent = 0
        self.tokens_sent = 0

    def outbox(self, request: Request) -> Outbox[Request]:
        box = Outbox(request, self._ready)
        with self._open_lock:
            self._open.add(box)
        with self._unanswered_lock:
            first = not self._unanswered
            self._unanswered.add(box)
        if first:  # the writer may be waiting on the queue alone: it now has sweeps to time
            self._ready.put(_SWEEP)
        return box

    def cancel(self, matches: Callable[[Request], bool]) -> int:
        """Any thread: flags the requests not yet ended that `matches` as cancelled, as Triton's
        cancellation would (the engine ends them at its next step); how many it flagged."""
        with self._open_lock:
            boxes = [box for box in self._open if matches(box.request)]
        for box in boxes:
            box.cancelled = True
        return len(boxes)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="llm-writer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Sends what is pending (the engine stopped first), then ends the thread."""
        self._ready.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def publish_stats(self, stats: Stats) -> None:
        """Any thread; only the latest snapshot is kept."""
        with self._stats_lock:
            self._stats = stats
            wake = not self._stats_queued
            self._stats_queued = True
        if wake:
            self._ready.put(_STATS)

    def _run(self) -> None:
        while True:
            item = self._next()
            if item is _STOP:
                self._stopping = True
                while self._waiting:
                    self._flush(heapq.heappop(self._waiting)[2])
                for box in list(self._short):
                    self._flush(box)
                self._flush_stats(force=True)
                return
            try:
                if item is _STATS:
                    self._flush_stats()
                elif item is _SWEEP:
                    self._sweep()
                else:
                    assert isinstance(item, Outbox)
                    self._flush(item)
            except Exception:  # a bug here must not silence every stream
                logger.exception("the response writer failed on one item")

    def _next(self) -> object:
        """An outbox whose interval is over, `_SWEEP` when one is due, else what the queue
        brings first."""
        while True:
            now = time.monotonic()
            due = None
            if self._waiting:
                due, _, box = self._waiting[0]
                if due <= now:
                    heapq.heappop(self._waiting)
                    box.waiting = False
                    return box
            with self._unanswered_lock:
                unanswered = bool(self._unanswered)
            if unanswered:
                sweep_at = self._swept_at + UNANSWERED_CANCEL_CHECK_INTERVAL_S
                if sweep_at <= now:
                    return _SWEEP
                due = sweep_at if due is None else min(due, sweep_at)
            try:
                return self._ready.get(timeout=None if due is None else due - now)
            except queue.Empty:
                continue

    def _sweep(self) -> None:
        """Asks Triton whether the requests without a response for a while were cancelled;
        the engine drops those before they start (`Engine._drop_cancelled_waiting`)."""
        now = self._swept_at = time.monotonic()
        with self._unanswered_lock:
            boxes = list(self._unanswered)
        for box in boxes:
            if now - box.checked_at >= UNANSWERED_CANCEL_CHECK_INTERVAL_S:
                self._poll_cancelled(box)
                if box.cancelled:
                    self._answered(box)

    def _answered(self, box: Outbox[Request]) -> None:
        with self._unanswered_lock:
            self._unanswered.discard(box)

    def _may_wait(self, box: Outbox[Request]) -> bool:
        """Only a stream that sent its first response, does not end, and is not alone."""
        return (
            not self._stopping and box.sent_at is not None and not box.ending and self._streams >= 2
        )

    def _must_wait(self, box: Outbox[Request]) -> float | None:
        """When `box` may send next, if that is later than now."""
        if not self._interval or not self._may_wait(box) or box.sent_at is None:
            return None
        due = box.sent_at + self._interval
        return due if due > time.monotonic() else None

    def _flush_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._stats_lock:
            self._stats_queued = False
            if not force and now - self._stats_sent_at < STATS_INTERVAL_S:
                return  # kept: the engine's next publish wakes the writer again
            stats, self._stats = self._stats, None
        self._stats_sent_at = now
        if stats is not None and self._on_stats is not None:
            self._on_stats(stats)

    def _flush(self, box: Outbox[Request]) -> None:
        self._short.discard(box)
        if box.closed:
            box.take()
            return
        due = self._must_wait(box)
        if due is not None:
            if not box.waiting:
                box.waiting = True
                heapq.heappush(self._waiting, (due, next(self._order), box))
            return
        if self._may_wait(box) and box.wait_for_tokens(self._interval_tokens):
            self._short.add(box)
            return
        items = box.take()
        self._poll_cancelled(box)
        # The data before an error goes out first; nothing after the end does.
        end = next((i for i, item in enumerate(items) if isinstance(item, FinalError)), len(items))
        outputs = [item for item in items[:end] if isinstance(item, StepOutput)]
        for chunk in self._chunks(outputs):
            merged = merge_outputs(chunk)
            final = merged.finish_reason is not None
            self._transport.send(box.request, merged, final)
            self.responses_sent += 1
            self.tokens_sent += len(merged.token_ids)
            if box.sent_at is None:
                self._streams += 1
                self._answered(box)
            box.sent_at = time.monotonic()
            if final:
                self._close(box)
                return
        error = items[end] if end < len(items) else None
        if isinstance(error, FinalError):
            self._transport.send_error(box.request, error.message, error.kind)
            self._close(box)

    def _close(self, box: Outbox[Request]) -> None:
        box.closed = True
        self._answered(box)
        with self._open_lock:
            self._open.discard(box)
        if box.sent_at is not None:
            self._streams -= 1

    def _chunks(self, outputs: list[StepOutput]) -> list[list[StepOutput]]:
        if not outputs:
            return []
        if not self._cap:
            return [outputs]
        chunks: list[list[StepOutput]] = [[]]
        tokens = 0
        for out in outputs:
            if chunks[-1] and tokens + len(out.token_ids) > self._cap:
                chunks.append([])
                tokens = 0
            chunks[-1].append(out)
            tokens += len(out.token_ids)
        return chunks

    def _poll_cancelled(self, box: Outbox[Request]) -> None:
        now = time.monotonic()
        if box.cancelled or now - box.checked_at < CANCEL_CHECK_INTERVAL_S:
            return
        box.checked_at = now
        box.cancelled = self._transport.is_cancelled(box.request)
