"""The engine in a process of its own, so that its step never waits for the stub's GIL.

In the stub, every torch op of the engine's step released the GIL and had to take it back from
the response writer, which builds responses in Python meanwhile: served, the engine thread ran
84 % of the time it was runnable (docs/design.md, "The engine's process"). Here the engine runs
in a child process spawned by the `llm` stub, as vLLM's engine core runs apart from its API
server. One pipe joins them:

- stub -> engine: `("submit", key, params)`, `("cancel", key)`, `("stop",)`;
- engine -> stub: after each engine iteration, one `(outputs, stats)` message: every
  `(key, StepOutput | FinalError)` the iteration produced, and its `EngineStats`.

`EngineProcess` is the stub's side: `submit` takes the same sinks as `Engine.submit` (model.py's
outboxes), a reader thread hands each output to its sink and forwards a sink's cancellation to
the engine. If the engine process dies, every request in flight gets a final error and
`on_death` runs (model.py then ends the stub, whose death the launcher handles); so it does when
the engine process sends nothing for `engine_hang_timeout_s` (hung), which the reader then kills.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

from backend.config import LLMConfig
from backend.contract import ENGINE_DIED, SHUTTING_DOWN
from backend.engine import Engine, EngineStats, OutputSink
from backend.outputs import BUSY, INTERNAL, FinalError, StepOutput
from backend.params import EngineLimits, GenerationParams

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 60.0
"""How long `stop` waits for the engine process to answer its requests and exit."""
_HANG_GRACE_S = 1.0
"""A silent engine's last chance to answer before it is killed (`engine_hang_timeout_s`): an
idle one reports every 50 ms."""


@dataclass(frozen=True)
class EngineReady:
    """What the engine process reports once its model is loaded."""

    limits: EngineLimits
    description: str
    """The model, device, dtype and sizes, for the stub's log."""


def build_engine(config: LLMConfig, on_stats: Callable[[EngineStats], None] | None) -> Engine:
    """The engine `config` describes, its model loaded (in the engine process)."""
    import torch

    from backend.model_runner import ModelRunner

    torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 2) // 2))
    runner = ModelRunner(
        config.model_path,
        device=config.device,
        dtype=config.dtype,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        kv_cache_bytes=config.kv_cache_memory_mb * 2**20,
        fast_decode=config.fast_decode,
    )
    return Engine(
        runner,
        max_logprobs=config.max_logprobs,
        max_logprob_token_ids=config.max_logprob_token_ids,
        # Slots a smaller kv_cache_memory_mb leaves out become queue places: the adapter admits
        # max_num_seqs + max_queue_size model requests at once, reading both from the config.
        max_queue_size=config.max_queue_size + config.max_num_seqs - runner.num_slots,
        on_stats=on_stats,
        grammar_cache_size=config.grammar_cache_size,
        grammar_compile_timeout_s=config.grammar_compile_timeout_ms / 1000,
        grammar_disable_any_whitespace=config.grammar_disable_any_whitespace,
    )


class _Outgoing:
    """The engine process's side of the pipe: what one iteration produced, sent as one message."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._items: list[tuple[int, StepOutput | FinalError]] = []
        self._live: set[int] = set()
        """The requests that have not sent their final output yet."""
        self.cancelled: set[int] = set()

    def open(self, key: int) -> None:
        with self._lock:
            self._live.add(key)

    def add(self, key: int, item: StepOutput | FinalError, *, final: bool) -> None:
        with self._lock:
            self._items.append((key, item))
            if final:
                self._live.discard(key)
                self.cancelled.discard(key)

    def cancel(self, key: int) -> None:
        """A cancel that crossed its request's final output on the pipe is dropped: nothing
        would ever remove it (a soak counted thousands of client hang-ups)."""
        with self._lock:
            if key in self._live:
                self.cancelled.add(key)

    def flush(self, stats: EngineStats | None = None) -> None:
        """Sends what is pending, with `stats` (engine thread, each iteration). An idle engine
        iterates every 50 ms, and its stats go too: the writer passes stats on at most every
        50 ms, and counts on a later publish to bring what it held back."""
        with self._lock:
            items, self._items = self._items, []
            if items or stats is not None:
                self._conn.send((items, stats))

    def send(self, message: object) -> None:
        with self._lock:
            self._conn.send(message)


@dataclass
class _RemoteSink:
    """An `OutputSink` in the engine process for request `key` of the stub."""

    key: int
    outgoing: _Outgoing

    def send(self, output: StepOutput) -> None:
        self.outgoing.add(self.key, output, final=output.finish_reason is not None)

    def send_error(self, message: str, *, kind: str = INTERNAL) -> None:
        self.outgoing.add(self.key, FinalError(message, kind), final=True)

    def is_cancelled(self) -> bool:
        return self.key in self.outgoing.cancelled


def serve(
    conn: Connection, config: LLMConfig, prepare: Callable[[Engine], None] | None = None
) -> None:
    """The engine process's main: builds the engine (`prepare` sees it before it starts), then
    reads the stub's messages until `stop` or until the stub is gone (the pipe's end), when it
    exits too."""
    _log_to_stderr()
    _progress_bars_without_a_semaphore()
    outgoing = _Outgoing(conn)
    try:
        engine = build_engine(config, outgoing.flush)
        if prepare is not None:
            prepare(engine)
    except Exception as exc:
        logger.exception("the engine failed to start")
        outgoing.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    runner = engine.runner
    outgoing.send(
        (
            "ready",
            EngineReady(
                engine.limits,
                f"{config.model_path} on {runner.device} ({runner.dtype}), vocab "
                f"{runner.vocab_size}, context {runner.max_model_len}, {runner.num_slots} KV "
                "slots",
            ),
        )
    )
    engine.start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the stub is gone: nobody is left to answer
            os._exit(0)
        if message[0] == "submit":
            _, key, params = message
            sink = _RemoteSink(key, outgoing)
            outgoing.open(key)
            try:
                engine.submit(params, sink)
            except Exception as exc:  # a bug: this request fails, not every one in flight
                logger.exception("request %s could not be submitted", params.request_id)
                sink.send_error(f"internal error: {type(exc).__name__}: {exc}")
        elif message[0] == "cancel":
            outgoing.cancel(message[1])
        else:  # stop
            break
    engine.stop()  # every request in flight gets its final error
    outgoing.flush()
    conn.close()


def _progress_bars_without_a_semaphore() -> None:
    """tqdm's default lock (transformers' "Loading weights" bar) is a multiprocessing RLock: in
    this spawned process a named semaphore in /dev/shm, which only multiprocessing's resource
    tracker unlinks, at its exit; so each SIGKILL of the stub's group (a heal, a killed launcher)
    left one behind. A thread lock serves the bars of one process as well."""
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())


def _log_to_stderr() -> None:
    """The engine's own records (`backend.*`, INFO and up: a cancelled request, a failed
    iteration) on the stderr it shares with tritonserver, whose log that is; a spawned process
    starts with no logging set up, and would print only warnings, without their source."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s llm engine %(levelname)s %(name)s: %(message)s")
    )
    backend_logger = logging.getLogger("backend")
    backend_logger.addHandler(handler)
    backend_logger.setLevel(logging.INFO)


def engine_of(stub_pid: int) -> psutil.Process:
    """The engine process of the stub `stub_pid`: the child multiprocessing spawned (its other
    child is multiprocessing's resource tracker)."""
    for child in psutil.Process(stub_pid).children():
        with contextlib.suppress(psutil.Error):
            if "spawn_main" in " ".join(child.cmdline()):
                return child
    raise LookupError(f"process {stub_pid} runs no engine process")


def _python_executable() -> str:
    """The interpreter to spawn: inside Triton's stub `sys.executable` may be the stub binary,
    while the `python3` beside this venv's packages is the one the stub embeds."""
    executable = Path(sys.executable)
    if executable.name.startswith("python"):
        return str(executable)
    return str(Path(sys.prefix) / "bin" / "python3")


class EngineProcess:
    """The stub's handle on the engine process: `submit` like `Engine.submit`, `start`, `stop`."""

    def __init__(
        self,
        config: LLMConfig,
        on_stats: Callable[[EngineStats], None] | None = None,
        on_death: Callable[[], None] | None = None,
        prepare: Callable[[Engine], None] | None = None,
    ) -> None:
        """`prepare` runs in the engine process on the engine before it starts, so it must
        pickle (a module-level function, or a partial of one)."""
        self._config = config
        self._prepare = prepare
        self._on_stats = on_stats
        self._on_death = on_death
        self._keys = itertools.count()
        self._lock = threading.Lock()
        """Guards `_sinks`, `_cancel_sent` and sends on the pipe."""
        self._sinks: dict[int, OutputSink] = {}
        self._cancel_sent: set[int] = set()
        self._stopping = False
        self._conn: Connection | None = None
        self._process: Any = None  # multiprocessing's SpawnProcess
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> EngineReady:
        """Spawns the engine process and waits until its model is loaded."""
        context = multiprocessing.get_context("spawn")
        context.set_executable(_python_executable())
        conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=serve,
            args=(child_conn, self._config, self._prepare),
            name="llm-engine",
            daemon=True,
        )
        self._process.start()
        child_conn.close()  # the child holds its end: our copy would hide its death
        self._conn = conn
        try:
            kind, detail = conn.recv()
        except EOFError:
            self._process.join(timeout=5)
            raise RuntimeError(
                f"the engine process exited while starting (code {self._process.exitcode})"
            ) from None
        if kind != "ready":
            raise RuntimeError(f"the engine process failed to start: {detail}")
        self._reader = threading.Thread(target=self._read, name="llm-engine-reader", daemon=True)
        self._reader.start()
        # At interpreter exit multiprocessing terminates the (daemonic) engine process: that is
        # not a death. This handler runs first (registered after multiprocessing's).
        atexit.register(self._exiting)
        return detail

    def submit(self, params: GenerationParams, sink: OutputSink) -> None:
        key = next(self._keys)
        with self._lock:
            if self._stopping:
                sink.send_error(SHUTTING_DOWN, kind=BUSY)
                return
            self._sinks[key] = sink
            self._send(("submit", key, params))

    def _exiting(self) -> None:
        with self._lock:
            self._stopping = True

    def stop(self) -> None:
        """The engine answers every request in flight with a final error, then exits."""
        atexit.unregister(self._exiting)
        with self._lock:
            self._stopping = True
            self._send(("stop",))
        if self._reader is not None:
            self._reader.join(timeout=_STOP_TIMEOUT_S)
        if self._process is not None:
            self._process.join(timeout=_STOP_TIMEOUT_S)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()

    def _send(self, message: object) -> None:
        assert self._conn is not None
        with contextlib.suppress(OSError):  # the engine is gone: the reader answers for it
            self._conn.send(message)

    def _read(self) -> None:
        """Reader thread: each iteration's outputs to their sinks, stats on, cancels back; an
        engine silent for `engine_hang_timeout_s` is killed, and then read as dead."""
        assert self._conn is not None
        hang_timeout_s = None  # None: wait forever, until its loop runs (after the kernels'
        # warm-up, which compiles them on CUDA) and reports for the first time
        while True:
            try:
                # A second, short wait: after a pause of both processes (a VM stall, `docker
                # pause`) the first one has timed out by the clock, and a healthy engine answers.
                if not (self._conn.poll(hang_timeout_s) or self._conn.poll(_HANG_GRACE_S)):
                    self._kill_hung()
                    break  # one that cannot die (uninterruptible I/O) would never end the pipe
                items, stats = self._conn.recv()
            except (EOFError, OSError):
                break
            hang_timeout_s = self._config.engine_hang_timeout_s or None
            for key, item in items:
                self._deliver(key, item)
            if stats is not None and self._on_stats is not None:
                self._on_stats(stats)
            self._forward_cancels()
        self._fail_all()

    def _kill_hung(self) -> None:
        """A deadlocked engine, or one stuck in a forward, would hold its requests forever while
        Triton reports ready: killed, it is a death, which the stub and the launcher heal."""
        logger.error(
            "the engine process sent nothing for %d s (engine_hang_timeout_s): it is hung; "
            "killing it",
            self._config.engine_hang_timeout_s,
        )
        self._process.kill()

    def _deliver(self, key: int, item: StepOutput | FinalError) -> None:
        with self._lock:
            sink = self._sinks.get(key)
            ends = isinstance(item, FinalError) or item.finish_reason is not None
            if ends:
                self._sinks.pop(key, None)
                self._cancel_sent.discard(key)
        if sink is None:
            return
        if isinstance(item, FinalError):
            sink.send_error(item.message, kind=item.kind)
        else:
            sink.send(item)

    def _forward_cancels(self) -> None:
        with self._lock:
            for key, sink in self._sinks.items():
                if key not in self._cancel_sent and sink.is_cancelled():
                    self._cancel_sent.add(key)
                    self._send(("cancel", key))

    def _fail_all(self) -> None:
        """The pipe ended: after `stop`, anything unanswered; otherwise the engine died."""
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            died = not self._stopping
            self._stopping = True
        message = ENGINE_DIED if died else SHUTTING_DOWN
        if died:
            logger.error("%s; failing %d requests in flight", message, len(sinks))
        for sink in sinks.values():
            sink.send_error(message, kind=BUSY)  # the launcher restarts it: a retry may succeed
        if died and self._on_death is not None:
            self._on_death()
