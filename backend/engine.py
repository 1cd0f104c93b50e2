"""The generation engine: a thread that advances every active request by one token per iteration.

Continuous batching: between iterations new requests are admitted (prefilled into a free KV
slot) and finished or cancelled ones leave; each iteration runs one batched forward for all
active sequences, samples all rows in one vectorised call and gathers all rows' logprobs in one
`kernels.gather_logprobs_on_host` call, on the raw logits (docs/design.md, "Logprob semantics").
"""

from __future__ import annotations

import bisect
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from backend.contract import (
    ALLOWED_TOKEN_IDS,
    DEFAULT_MAX_LOGPROB_TOKEN_IDS,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_QUEUE_SIZE,
    MIN_TOKENS,
    NO_TOKEN_FITS,
    SERVER_BUSY,
    SHUTTING_DOWN,
    STRUCTURED_OUTPUT,
)
from backend.detokenizer import IncrementalDetokenizer
from backend.model_runner import ModelRunner
from backend.outputs import BUSY, CANCELLED, INTERNAL, INVALID, PromptLogprobs, StepOutput
from backend.params import EngineLimits, GenerationParams
from backend.sampling import NO_TOKEN, RowState, batch_from_rows, sample
from backend.stopping import LENGTH, STOP, StopStringMatcher, token_stop_reason
from backend.token_bytes import special_token_ids, token_bytes_table
from kernels import HostLogprobs, gather_logprobs_on_host
from kernels.logprobs import warmup as warmup_kernels

if TYPE_CHECKING:  # xgrammar is imported when a request first asks for a structured output
    import xgrammar as xgr

    from backend.grammar import GrammarCompiler, TokenBitmask

logger = logging.getLogger(__name__)


class OutputSink(Protocol):
    """Where a request's outputs go (`backend.response_writer.Outbox` in model.py). Called on
    the engine thread every step, so each method must return at once: no IPC."""

    def send(self, output: StepOutput) -> None:
        """A data output; the last one when `output.finish_reason` is set."""

    def send_error(self, message: str, *, kind: str = INTERNAL) -> None:
        """The end of the request, as an error of `kind` (INTERNAL, CANCELLED, BUSY or INVALID)."""

    def is_cancelled(self) -> bool: ...


@dataclass
class EngineStats:
    active_sequences: int = 0
    waiting_requests: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of the KV-cache slots in use."""
    generated_tokens: int = 0
    cancelled_requests: int = 0
    finished_requests: int = 0
    grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_cache_hits: int = 0


@dataclass
class _Pending:
    """A submitted request not yet in the batch; `grammar` is its structured output's compile."""

    params: GenerationParams
    sink: OutputSink
    grammar: Future[xgr.CompiledGrammar] | None = None
    deadline: float = 0.0
    """When a compile still running makes the request fail (monotonic seconds)."""
    started: bool = False
    """In `_active`: it left the queue as it joined the batch (`Engine._activate`)."""
    arrival: int = 0
    """Its place in the order the engine thread took requests in (`Engine._take_incoming`)."""


_WAKE = object()
"""Put on the queue when a compile ends, so that an idle engine admits its request at once."""


@dataclass
class _Sequence:
    params: GenerationParams
    sink: OutputSink
    sampling: RowState
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    stop_ids: frozenset[int]
    slot: int = -1
    cached_len: int = 0
    """Positions in the KV cache; the last sampled token is not among them until it is fed."""
    logits: torch.Tensor | None = None
    generated: int = 0
    sent_first: bool = False
    prompt: PromptLogprobs | None = None
    logprob_ids: np.ndarray | None = None
    last_token: int = -1
    finished: bool = False
    matcher: xgr.GrammarMatcher | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it (`StepOutput.stop_reason`)."""

    def next_logits(self) -> torch.Tensor:
        """The logits the next token is sampled from (set by each decode, None once sampled:
        a prompt's first token is sampled right after its prefill)."""
        if self.logits is None:
            raise RuntimeError(f"request {self.params.request_id}: no logits to sample from")
        return self.logits

    @property
    def total_len(self) -> int:
        return len(self.params.prompt_ids) + self.generated


class _Sampled(NamedTuple):
    """A token sampled and past the stop rules, whose output waits for its logprobs."""

    seq: _Sequence
    row: int
    """Its row in the batch it was sampled with."""
    token: int
    text: str
    reason: str | None


class _Gather(NamedTuple):
    """One step's logprob gather, waiting for the worker (`Engine._start_gathers`)."""

    done: Future[HostLogprobs | None]
    logits: torch.Tensor
    sampled: torch.Tensor
    rows: list[_Sequence]


class _RowLogprobs(NamedTuple):
    """One sequence's logprobs at one step: [1], [1, k], [1, k], [1, M]."""

    sampled: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    token_logprobs: np.ndarray


def _read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


_NO_LOGPROBS = _RowLogprobs(
    _read_only(np.zeros(1, np.float32)),
    _read_only(np.zeros((1, 0), np.int32)),
    _read_only(np.zeros((1, 0), np.float32)),
    _read_only(np.zeros((1, 0), np.float32)),
)
"""A row without logprobs: the same arrays in every output, so that a step's outputs pickle
them once for the engine's process pipe (16 outputs: 0.097 -> 0.025 ms, 0.056 -> 0.021 to
unpickle)."""


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        max_logprob_token_ids: int = DEFAULT_MAX_LOGPROB_TOKEN_IDS,
        max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
        on_stats: Callable[[EngineStats], None] | None = None,
        grammar_cache_size: int = 64,
        grammar_compile_timeout_s: float = 10.0,
        grammar_disable_any_whitespace: bool = False,
    ) -> None:
        """`max_queue_size`: requests waiting beyond the free slots, past which new ones are
        refused (a request waits from `submit` until its first token).
        `grammar_compile_timeout_s`: a request whose structured output takes longer to compile
        is refused (the compile goes on, and its grammar is cached)."""
        self.runner = runner
        self.max_queue_size = max_queue_size
        self.grammar_compile_timeout_s = grammar_compile_timeout_s
        self.grammar_cache_size = grammar_cache_size
        self.grammar_disable_any_whitespace = grammar_disable_any_whitespace
        self._grammars: GrammarCompiler | None = None
        self._bitmask: TokenBitmask | None = None
        self.limits = EngineLimits(
            vocab_size=runner.vocab_size,
            max_model_len=runner.max_model_len,
            max_logprobs=max_logprobs,
            max_logprob_token_ids=max_logprob_token_ids,
            sampling_defaults=runner.sampling_defaults,
            max_new_tokens=runner.max_new_tokens,
        )
        self.token_bytes = token_bytes_table(runner.tokenizer, runner.vocab_size)
        self._skip_ids = special_token_ids(runner.tokenizer)
        self._on_stats = on_stats
        self.stats = EngineStats()
        self._incoming: queue.Queue[_Pending | object] = queue.Queue()
        """What `submit` hands the engine thread: requests, and a wake-up when a compile ends."""
        self._waiting: deque[_Pending] = deque()
        """Taken from `_incoming`, waiting for a slot, in arrival order."""
        self._queued = 0
        """Requests submitted and not yet started or ended: `submit`'s bound, and the metric."""
        self._queued_lock = threading.Lock()
        self._closed = False
        """Set once by `_end_in_flight`: `submit` then refuses instead of queueing."""
        self._compiling: list[_Pending] = []
        """Out of the batch until their grammar is compiled; then back in `_waiting`, in their
        place by arrival, as vLLM keeps a request waiting for its grammar in its queue."""
        self._arrivals = 0
        """Requests taken from `_incoming` so far: each one's place in the arrival order."""
        self._active: list[_Sequence] = []
        # The last decode's logits [B, V] and the sequences of its rows: reused as the next
        # step's batch while membership is unchanged, instead of re-stacking the rows.
        self._decoded: tuple[torch.Tensor, list[_Sequence]] | None = None
        # Each step's logprobs are gathered on this thread while the engine thread runs the next
        # forward's lm_head, and the outputs go once both are done (docs/design.md, "Logprobs
        # beside the next forward"). CPU only: on CUDA the gather is one kernel and a copy of
        # its few results, on the engine thread, before the next forward is queued.
        self._logprob_worker = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-logprobs")
            if runner.device.type == "cpu"
            else None
        )
        self._unsent: list[tuple[list[_Sampled], Future[HostLogprobs | None]]] = []
        """Sampled tokens whose outputs go at the end of the iteration, with their logprobs."""
        self._to_gather: list[_Gather] = []
        """Gathers for the worker that wait for the next forward's lm_head (`_start_gathers`)."""
        self._running = False
        self._thread: threading.Thread | None = None

    # --- public API (any thread) ----------------------------------------------------------------
    def start(self) -> None:
        # Compile the logprob kernel's variants now, not in the middle of a request (CUDA only).
        warmup_kernels(
            self.runner.device,
            [self.runner.dtype],
            self.runner.vocab_size,
            top_ks=(0, 1, self.limits.max_logprobs),
            return_ranks=(False,),
        )
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop; requests still in flight get a final error response. The engine
        thread ends them when its current step returns, so a step longer than `timeout_s` never
        races the ending (a sink answered twice, or a queue walked while it changes)."""
        self._running = False
        if self._thread is None:
            self._end_in_flight()
            return
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.warning(
                "the engine thread is still in a step after %.0f s; its requests end when it "
                "returns",
                timeout_s,
            )

    def submit(self, params: GenerationParams, sink: OutputSink) -> None:
        """Queue a validated request; responses go to `sink` from the engine thread."""
        with self._queued_lock:
            closed = self._closed
            waiting = self._queued
            # Free slots are room too: a burst larger than the queue, on a server with slots
            # free, is admitted at the next iteration, not refused.
            accepted = waiting < self.max_queue_size + self.runner.num_slots - len(self._active)
            if not closed and accepted:
                self._queued += 1
        if closed:
            sink.send_error(SHUTTING_DOWN, kind=BUSY)
            return
        if not accepted:
            sink.send_error(
                f"{SERVER_BUSY}: {waiting} requests are waiting for a sequence slot; retry later",
                kind=BUSY,
            )
            return
        pending = _Pending(params, sink)
        if params.structured_output is not None:
            try:
                pending.grammar = self._grammar_compiler().compile(params.structured_output)
            except BaseException:  # the caller fails the request: it holds no place
                self._leave_queue()
                raise
            pending.deadline = time.monotonic() + self.grammar_compile_timeout_s
            if not pending.grammar.done():
                pending.grammar.add_done_callback(lambda _: self._incoming.put(_WAKE))
        with self._queued_lock:  # `_end_in_flight` drains `_incoming` once, under this lock
            if not self._closed:
                self._incoming.put(pending)
                return
        self._leave_queue()
        sink.send_error(SHUTTING_DOWN, kind=BUSY)

    def _grammar_compiler(self) -> GrammarCompiler:
        """Made on the first structured-output request: only then is xgrammar imported (an
        image without it serves everything else)."""
        if self._grammars is None:
            from backend.grammar import GrammarCompiler, TokenBitmask

            runner = self.runner
            self._bitmask = TokenBitmask(runner.num_slots, runner.vocab_size)
            self._grammars = GrammarCompiler(
                runner.tokenizer,
                runner.vocab_size,
                runner.eos_ids,
                self.grammar_cache_size,
                disable_any_whitespace=self.grammar_disable_any_whitespace,
            )
        return self._grammars

    # --- engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while self._running:
            try:
                self._admit()
                if self._active:
                    self._step()
                self._send_sampled()
            except Exception as exc:  # a bug must not kill the thread or hang the streams
                logger.exception("engine iteration failed")
                unsent = {id(s.seq): s.seq for sampled, _ in self._unsent for s in sampled}
                self._unsent.clear()
                self._to_gather.clear()
                for seq in {**unsent, **{id(seq): seq for seq in self._active}}.values():
                    seq.sink.send_error(f"internal error: {exc}")
                self._active.clear()
            self._publish_stats()
        self._end_in_flight()

    def _end_in_flight(self) -> None:
        """After the loop: every request still active or queued gets its final error."""
        with self._queued_lock:
            self._closed = True
            waiting = [*self._waiting, *self._compiling]
            while not self._incoming.empty():
                item = self._incoming.get_nowait()
                if isinstance(item, _Pending):
                    waiting.append(item)
        for seq in self._active:
            seq.sink.send_error(SHUTTING_DOWN, kind=BUSY)
        self._active.clear()
        self._waiting.clear()
        self._compiling.clear()
        for pending in waiting:
            self._leave_queue()
            pending.sink.send_error(SHUTTING_DOWN, kind=BUSY)
        if self._grammars is not None:
            self._grammars.close()
        if self._logprob_worker is not None:
            self._logprob_worker.shutdown()

    def _admit(self) -> None:
        self._take_incoming(block=not (self._active or self._waiting))
        self._sort_compiling()
        self._drop_cancelled_waiting()
        while len(self._active) < self.runner.num_slots and self._waiting:
            pending = self._waiting.popleft()
            try:
                self._start_sequence(pending)
            except Exception as exc:  # not yet in `_active`: answer it here, or it never ends
                logger.exception("request %s failed to start", pending.params.request_id)
                pending.sink.send_error(f"internal error: {exc}")
            finally:
                if not pending.started:  # it ended at once, or failed
                    self._leave_queue()
            self._publish_stats()  # in its own process, its first token leaves with the stats

    def _activate(self, pending: _Pending, seq: _Sequence) -> None:
        """Moves a started request from the queue's count to the batch in one step, so that
        `submit`, which counts its room from both, never sees it in neither or in both."""
        with self._queued_lock:
            self._active.append(seq)
            self._queued -= 1
        pending.started = True

    def _take_incoming(self, block: bool) -> None:
        """Moves what `submit` queued to `_waiting` (or `_compiling`, grammar unfinished);
        wake-ups only end the wait. `block`: an idle engine waits up to 50 ms for work."""
        try:
            item = self._incoming.get(timeout=0.05) if block else self._incoming.get_nowait()
            while True:
                if isinstance(item, _Pending):
                    item.arrival = self._arrivals
                    self._arrivals += 1
                    if item.grammar is not None and not item.grammar.done():
                        self._compiling.append(item)
                    else:
                        self._waiting.append(item)
                item = self._incoming.get_nowait()
        except queue.Empty:
            return

    def _drop_cancelled_waiting(self) -> None:
        """Ends the waiting requests whose client left (vLLM aborts them at once too): they
        neither hold a place in the queue nor count as load until a slot frees."""
        for queued in (self._waiting, self._compiling):
            flagged = [(pending, pending.sink.is_cancelled()) for pending in queued]
            if any(cancelled for _, cancelled in flagged):
                queued.clear()
                queued.extend(pending for pending, cancelled in flagged if not cancelled)
                for pending, cancelled in flagged:
                    if cancelled:
                        self._leave_queue()
                        self._cancel(pending.params, pending.sink, "before it started")

    def _leave_queue(self) -> None:
        with self._queued_lock:
            self._queued -= 1

    def _sort_compiling(self) -> None:
        """Compiled requests rejoin `_waiting` in their place; those past their deadline are
        refused."""
        if not self._compiling:
            return
        now, still = time.monotonic(), []
        for pending in self._compiling:
            assert pending.grammar is not None
            if pending.grammar.done():
                bisect.insort(self._waiting, pending, key=lambda queued: queued.arrival)
            elif now >= pending.deadline and not pending.grammar.running():
                # Other requests' specs held every compile thread: the load's fault, not the
                # request's (it compiles later, and is cached).
                self._leave_queue()
                pending.sink.send_error(
                    f"{SERVER_BUSY}: every grammar compile thread was busy for "
                    f"{self.grammar_compile_timeout_s:g} s; retry later",
                    kind=BUSY,
                )
            elif now >= pending.deadline:
                self._leave_queue()
                pending.sink.send_error(
                    f"{STRUCTURED_OUTPUT}: compiling it took longer than "
                    f"{self.grammar_compile_timeout_s:g} s (grammar_compile_timeout_ms)",
                    kind=INVALID,
                )
            else:
                still.append(pending)
        self._compiling = still

    def _start_sequence(self, pending: _Pending) -> None:
        params, sink = pending.params, pending.sink
        matcher = None
        if pending.grammar is not None:
            try:
                matcher = self._grammar_compiler().matcher(pending.grammar.result())
            except ValueError as exc:  # it does not compile
                sink.send_error(f"{STRUCTURED_OUTPUT}: {exc}", kind=INVALID)
                return
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        stop_ids = frozenset(params.stop_token_ids)
        # `min_tokens` bans EOS also with `ignore_eos`, as vLLM's MinTokensLogitsProcessor does.
        banned_early = stop_ids | self.runner.eos_ids
        if not params.ignore_eos:
            stop_ids = banned_early
        seq = _Sequence(
            params=params,
            sink=sink,
            sampling=RowState(
                params, self.runner.vocab_size, self.runner.device, seed, banned_early
            ),
            detokenizer=IncrementalDetokenizer(self.token_bytes, self._skip_ids),
            stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output),
            stop_ids=stop_ids,
            matcher=matcher,
        )
        if params.logprob_token_ids:
            seq.logprob_ids = np.array(params.logprob_token_ids, dtype=np.int64)
        if params.max_tokens == 0 and not params.wants_prompt_logprobs:
            self._finish(seq, self._empty_output(seq, LENGTH))
            return
        seq.slot = len(self._active)
        logits = self.runner.prefill(
            seq.slot, params.prompt_ids, all_positions=params.wants_prompt_logprobs
        )
        if params.wants_prompt_logprobs:
            seq.prompt = self._prompt_logprobs(params, logits[:-1])
        seq.cached_len = len(params.prompt_ids)
        logger.debug(
            "request %s: %d prompt tokens in slot %d",
            params.request_id,
            len(params.prompt_ids),
            seq.slot,
        )
        if params.max_tokens == 0:
            self._finish(seq, self._empty_output(seq, LENGTH))
            return
        # Its first token now, not after the other admissions' prefills: a burst of 16 prompts
        # otherwise waits for all 16 (docs/design.md, "Time to first token").
        self._sample([seq], logits[-1:])
        self._send_sampled()
        if not seq.finished:
            self._activate(pending, seq)

    def _prompt_logprobs(self, params: GenerationParams, logits: torch.Tensor) -> PromptLogprobs:
        """One kernel call over the prompt positions: position i scores token i + 1, and every
        position asks the same ids (padded form, without padding)."""
        # int64 even when empty: a one-token prompt has no position to score.
        targets = torch.tensor(params.prompt_ids[1:], dtype=torch.int64, device=logits.device)
        ids = params.prompt_logprob_token_ids
        rows = len(targets)
        out = gather_logprobs_on_host(
            logits,
            targets,
            top_k=params.prompt_logprobs or 0,
            token_ids=np.tile(np.asarray(ids, np.int64), (rows, 1)) if ids else None,
        )
        return PromptLogprobs(
            ids=list(params.prompt_ids),
            token_bytes=[self.token_bytes[i] for i in params.prompt_ids],
            logprobs=out.sampled_logprobs,
            top_ids=out.top_ids,
            top_logprobs=out.top_logprobs,
            top_bytes=[self.token_bytes[i] for i in out.top_ids.reshape(-1).tolist()],
            token_id_logprobs=out.token_logprobs.reshape(rows, len(ids)),
            token_id_bytes=[self.token_bytes[i] for i in ids],
        )

    def _step(self) -> None:
        """Sample every row that has logits (the rows admitted since the last step were sampled
        at admission), then one decode for all active rows."""
        self._drop_cancelled()
        rows = [seq for seq in self._active if seq.logits is not None]
        if rows:
            self._sample(rows, self._batch_logits(rows))
        self._compact()
        if self._active:
            new_logits = self.runner.decode(
                [seq.last_token for seq in self._active],
                [seq.cached_len for seq in self._active],
                before_lm_head=self._start_gathers,
            )
            for seq, row_logits in zip(self._active, new_logits, strict=True):
                seq.logits = row_logits
                seq.cached_len += 1
            self._decoded = (new_logits, list(self._active))

    def _sample(self, rows: list[_Sequence], logits: torch.Tensor) -> None:
        """One token for each row from `logits` [len(rows), V]: the stop rules now, so that the
        next forward knows who goes on; the outputs, with their logprobs, at the iteration's
        end (`_send_sampled`)."""
        batch = batch_from_rows([s.sampling for s in rows], self.runner.vocab_size, logits.device)
        constrained = [(row, s.matcher) for row, s in enumerate(rows) if s.matcher is not None]
        if constrained and self._bitmask is not None:
            batch.grammar_mask = self._bitmask.fill(constrained)
        sampled = sample(logits, batch)
        accepted = []
        for row, (seq, token) in enumerate(zip(rows, sampled.tolist(), strict=True)):
            seq.logits = None
            step = self._advance(seq, token)
            if step is not None:
                accepted.append(_Sampled(seq, row, token, *step))
        # On CPU the gather starts when the next forward reaches its lm_head (`_start_gathers`):
        # its worker then takes the GIL beside one long matmul, not beside this loop's Python
        # or the layers' torch calls (docs/design.md, "Logprobs beside the next forward").
        self._unsent.append((accepted, self._gather_soon(logits, sampled, rows)))

    def _gather_soon(
        self, logits: torch.Tensor, sampled: torch.Tensor, rows: list[_Sequence]
    ) -> Future[HostLogprobs | None]:
        """`_gather`'s result: on CPU from the logprob worker, once `_start_gathers` has handed
        it over; else done now."""
        done: Future[HostLogprobs | None] = Future()
        if self._logprob_worker is not None and any(s.params.wants_logprobs for s in rows):
            self._to_gather.append(_Gather(done, logits, sampled, rows))
        else:
            done.set_result(self._gather(logits, sampled, rows))
        return done

    def _start_gathers(self) -> None:
        """Hands the waiting gathers to the logprob worker. The next forward calls this right
        before its lm_head, one matmul that holds no GIL, so that the worker's numpy calls do
        not make the layers' many short torch calls wait for the GIL (docs/design.md, "Logprobs
        beside the next forward"); `_send_sampled` calls it before it waits for them."""
        for gather in self._to_gather:
            assert self._logprob_worker is not None
            self._logprob_worker.submit(self._gather_into, gather)
        self._to_gather.clear()

    def _gather_into(self, gather: _Gather) -> None:
        """The logprob worker's task: `_gather`, its result or error into the step's future."""
        try:
            gather.done.set_result(self._gather(gather.logits, gather.sampled, gather.rows))
        except BaseException as exc:
            gather.done.set_exception(exc)

    def _send_sampled(self) -> None:
        """The outputs of the tokens sampled in this iteration, in order, with their logprobs."""
        self._start_gathers()  # those no forward started: no row left, or a first token
        for accepted, logprobs in self._unsent:
            gathered = logprobs.result()
            for s in accepted:
                row = self._row_logprobs(s.seq, s.row, gathered)
                output = self._step_output(s.seq, s.token, s.text, s.reason, row)
                if s.reason is None:
                    s.seq.sink.send(output)
                else:
                    self._finish(s.seq, output)
        self._unsent.clear()

    def _batch_logits(self, rows: list[_Sequence]) -> torch.Tensor:
        if self._decoded is not None:
            logits, decoded_rows = self._decoded
            if len(decoded_rows) == len(rows) and all(
                a is b for a, b in zip(decoded_rows, rows, strict=True)
            ):
                return logits
        return torch.stack([seq.next_logits() for seq in rows])

    def _compact(self) -> None:
        """Free the slots of finished sequences, keeping active ones in slots 0..B-1: the last
        sequence moves into each hole, so only one sequence's cache is copied per departure."""
        active = self._active
        for seq in sorted((s for s in active if s.finished), key=lambda s: s.slot, reverse=True):
            last = active.pop()
            if last is not seq:
                self.runner.move(last.slot, seq.slot, last.cached_len)
                last.slot = seq.slot
                active[seq.slot] = last

    def _drop_cancelled(self) -> None:
        for seq in self._active:
            if seq.sink.is_cancelled():
                seq.finished = True
                self._cancel(seq.params, seq.sink, f"after {seq.generated} tokens")
        self._compact()

    def _cancel(self, params: GenerationParams, sink: OutputSink, when: str) -> None:
        """Ends a request its client cancelled, started or still waiting (vLLM aborts both)."""
        logger.info("request %s cancelled %s", params.request_id, when)
        self.stats.cancelled_requests += 1
        sink.send_error("the request was cancelled", kind=CANCELLED)

    def _gather(
        self, logits: torch.Tensor, sampled: torch.Tensor, rows: list[_Sequence]
    ) -> HostLogprobs | None:
        """All rows' logprobs in one kernel call, on the host."""
        if not any(seq.params.wants_logprobs for seq in rows):
            return None
        top_k = max(seq.params.logprobs or 0 for seq in rows)
        return gather_logprobs_on_host(
            logits, sampled, top_k=top_k, token_ids=self._padded_token_ids(rows)
        )

    @staticmethod
    def _padded_token_ids(rows: list[_Sequence]) -> np.ndarray | None:
        """The rows' explicit ids as [B, Kmax], -1 past a row's own (-inf there): on CPU a 2-D
        gather took 0.14 ms for 16 x 1024 ids against 0.42 for flat ids with offsets (the
        same rows usually ask the same labels, so there is little padding)."""
        lengths = [len(seq.params.logprob_token_ids) for seq in rows]
        width = max(lengths)
        if width == 0:
            return None
        if min(lengths) == width:
            return np.stack([s.logprob_ids for s in rows if s.logprob_ids is not None])
        padded = np.full((len(rows), width), -1, dtype=np.int64)
        for row, seq in enumerate(rows):
            if seq.logprob_ids is not None:
                padded[row, : len(seq.logprob_ids)] = seq.logprob_ids
        return padded

    @staticmethod
    def _no_token_fits(seq: _Sequence) -> tuple[str, str]:
        """The error (message, kind) of a row whose bans left no id, naming the inputs in effect
        that ban, the first as the culprit: only a grammar, MIN_TOKENS (EOS and stop ids early)
        and ALLOWED_TOKEN_IDS ban (a logit bias is finite, and allowed ids alone leave one).
        With none of them, the model's logits were all -inf: an internal error."""
        banning = [
            name
            for name, bans in (
                (STRUCTURED_OUTPUT, seq.matcher is not None),
                (MIN_TOKENS, seq.generated < seq.params.min_tokens),
                (ALLOWED_TOKEN_IDS, bool(seq.params.allowed_token_ids)),
            )
            if bans
        ]
        if not banning:
            return f"internal error: {NO_TOKEN_FITS}every logit is -inf", INTERNAL
        *first, last = banning
        ban = f"{', '.join(first)} and {last} together ban" if first else f"{last} bans"
        return f"{banning[0]}: {NO_TOKEN_FITS}{ban} every id", INVALID

    def _advance(self, seq: _Sequence, token: int) -> tuple[str, str | None] | None:
        """One sampled token through the stop rules: its text and finish reason (the sequence
        is then finished), or None when it ended the request with an error."""
        if token == NO_TOKEN:
            seq.finished = True
            message, kind = self._no_token_fits(seq)
            seq.sink.send_error(message, kind=kind)
            return None
        seq.generated += 1
        seq.last_token = token
        seq.sampling.observe(token)
        self.stats.generated_tokens += 1
        reason = self._token_stop_reason(seq, token)
        # Every stop id is its own stop reason, the generation config's other EOS ids included,
        # but the tokenizer's EOS, which vLLM's `check_stop` tests first (null).
        if reason == STOP and (
            seq.params.ignore_eos or token != self.runner.tokenizer.eos_token_id
        ):
            seq.stop_reason = token
        if seq.matcher is not None:
            if not seq.matcher.accept_token(token):  # the mask let through what it refuses
                seq.finished = True
                seq.sink.send_error(f"{STRUCTURED_OUTPUT}: the grammar refused token {token}")
                return None
            if reason is None and seq.matcher.is_terminated():
                reason = STOP
        text, reason = self._new_text(seq, token, reason)
        seq.finished = reason is not None
        return text, reason

    def _token_stop_reason(self, seq: _Sequence, token: int) -> str | None:
        return token_stop_reason(
            token,
            generated=seq.generated,
            total_len=seq.total_len,
            max_tokens=seq.params.max_tokens,
            max_model_len=self.limits.max_model_len,
            stop_ids=seq.stop_ids,
        )

    @staticmethod
    def _new_text(seq: _Sequence, token: int, reason: str | None) -> tuple[str, str | None]:
        """The text `token` completes, cut at a stop string (which makes the reason `stop`)."""
        # A stop token's own text is returned only with include_stop_str_in_output (vLLM); its
        # id and logprobs always are.
        hidden = token in seq.stop_ids and not seq.params.include_stop_str_in_output
        piece = "" if hidden else seq.detokenizer.push(token)
        if reason is not None:
            piece += seq.detokenizer.flush()
        # Stop strings count once the output exceeds min_tokens, as vLLM checks them; one in a
        # stop token's own text (with include_stop_str_in_output) cuts it and is the stop reason,
        # as in vLLM's detokenizer `update`.
        text, stop_string = seq.stop_matcher.push(
            piece, search=seq.generated > seq.params.min_tokens
        )
        if stop_string is not None:
            seq.stop_reason = stop_string
            return text, STOP
        if reason is not None:
            text += seq.stop_matcher.flush()
        return text, reason

    @staticmethod
    def _row_logprobs(seq: _Sequence, row: int, gathered: HostLogprobs | None) -> _RowLogprobs:
        """This row's slice of the batch's gathered logprobs, or empty ones if none were asked."""
        k, m = seq.params.logprobs or 0, len(seq.params.logprob_token_ids)
        if gathered is None or not seq.params.wants_logprobs:
            return _NO_LOGPROBS
        # No top-k or no ids: _NO_LOGPROBS's shared empties, which a step's outputs pickle once.
        none = _NO_LOGPROBS
        return _RowLogprobs(
            sampled=gathered.sampled_logprobs[row : row + 1],
            top_ids=gathered.top_ids[row : row + 1, :k] if k else none.top_ids,
            top_logprobs=gathered.top_logprobs[row : row + 1, :k] if k else none.top_logprobs,
            token_logprobs=gathered.token_logprobs[row : row + 1, :m] if m else none.token_logprobs,
        )

    def _step_output(
        self, seq: _Sequence, token: int, text: str, reason: str | None, row: _RowLogprobs
    ) -> StepOutput:
        return StepOutput(
            token_ids=[token],
            text=text,
            token_bytes=[self.token_bytes[token]],
            logprobs=row.sampled,
            top_ids=row.top_ids,
            top_logprobs=row.top_logprobs,
            top_bytes=[self.token_bytes[i] for i in row.top_ids.reshape(-1).tolist()],
            token_id_logprobs=row.token_logprobs,
            token_id_bytes=self._first_response_id_bytes(seq),
            finish_reason=reason,
            prompt_tokens=len(seq.params.prompt_ids),
            completion_tokens=seq.generated,
            prompt=self._first_response_prompt(seq),
            stop_reason=seq.stop_reason,
        )

    def _first_response_id_bytes(self, seq: _Sequence) -> list[bytes]:
        if seq.sent_first:
            return []
        seq.sent_first = True
        return [self.token_bytes[i] for i in seq.params.logprob_token_ids]

    @staticmethod
    def _first_response_prompt(seq: _Sequence) -> PromptLogprobs | None:
        prompt, seq.prompt = seq.prompt, None
        return prompt

    def _empty_output(self, seq: _Sequence, reason: str) -> StepOutput:
        m = len(seq.params.logprob_token_ids)
        k = seq.params.logprobs or 0
        return StepOutput(
            token_ids=[],
            text="",
            token_bytes=[],
            logprobs=np.zeros(0, np.float32),
            top_ids=np.zeros((0, k), np.int32),
            top_logprobs=np.zeros((0, k), np.float32),
            top_bytes=[],
            token_id_logprobs=np.zeros((0, m), np.float32),
            token_id_bytes=self._first_response_id_bytes(seq),
            finish_reason=reason,
            prompt_tokens=len(seq.params.prompt_ids),
            completion_tokens=seq.generated,
            prompt=self._first_response_prompt(seq),
            stop_reason=seq.stop_reason,
        )

    def _finish(self, seq: _Sequence, output: StepOutput) -> None:
        logger.debug(
            "request %s: %s after %d tokens",
            seq.params.request_id,
            output.finish_reason,
            seq.generated,
        )
        seq.finished = True
        seq.logits = None
        self.stats.finished_requests += 1
        seq.sink.send(output)

    def _publish_stats(self) -> None:
        self.stats.active_sequences = len(self._active)
        self.stats.waiting_requests = self._queued
        if self._grammars is not None:
            grammars = self._grammars.stats
            self.stats.grammar_compiles = grammars.compiles
            self.stats.grammar_compile_seconds = grammars.compile_seconds
            self.stats.grammar_cache_hits = grammars.cache_hits
        self.stats.kv_cache_usage = len(self._active) / self.runner.num_slots
        if self._on_stats is not None:
            self._on_stats(replace(self.stats))  # a snapshot for another thread
