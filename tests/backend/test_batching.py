"""Continuous batching: results do not depend on what else is in the batch; slots are reused."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from backend.default_model import PASSAGE
from backend.engine import _WAKE, Engine
from backend.model_runner import ModelRunner
from backend.outputs import BUSY, CANCELLED
from backend.params import GenerationParams
from tests.reference import reference_logprobs, tokenizer
from tests.sinks import RecordingSink


def run(engine: Engine, requests: list[GenerationParams], sinks=None) -> list[RecordingSink]:
    sinks = sinks or [RecordingSink() for _ in requests]
    for params, sink in zip(requests, sinks, strict=True):
        engine.submit(params, sink)
    for sink in sinks:
        assert sink.done.wait(120), "a request never finished"
    return sinks


def _requests(model_dir: Path, count: int) -> list[GenerationParams]:
    """Different prompt and output lengths; every other one asks for logprobs."""
    passage = tokenizer(model_dir)(PASSAGE)["input_ids"]
    rng = np.random.default_rng(0)
    requests = []
    for i in range(count):
        if i % 2:
            prompt = passage[i : i + 2 + 3 * i]
        else:
            prompt = rng.integers(0, 1000, size=1 + 5 * i).tolist()
        requests.append(
            GenerationParams(
                prompt_ids=prompt,
                max_tokens=4 + 3 * i,
                temperature=0.0,
                ignore_eos=True,
                logprobs=3 if i % 2 else None,
                logprob_token_ids=[5, 17, 999] if i % 3 == 0 else [],
            )
        )
    return requests


def test_sixteen_streams_together_equal_each_alone(engine, model_dir):
    requests = _requests(model_dir, 16)
    alone = [run(engine, [params])[0] for params in requests]
    together = run(engine, requests)
    worst = 0.0
    for one, many, params in zip(alone, together, requests, strict=True):
        assert many.error is None
        assert many.token_ids == one.token_ids
        assert len(many.token_ids) == params.max_tokens
        assert "".join(o.text for o in many.outputs) == "".join(o.text for o in one.outputs)
        if params.wants_logprobs:
            ref = reference_logprobs(model_dir, params.prompt_ids, many.token_ids)
            sampled = ref[np.arange(len(many.token_ids)), many.token_ids]
            np.testing.assert_allclose(many.logprobs, sampled, atol=1e-4)
            worst = max(worst, float(np.abs(many.logprobs - one.logprobs).max()))
        if params.logprob_token_ids:
            np.testing.assert_allclose(
                many.id_logprobs, ref[:, params.logprob_token_ids], atol=1e-4
            )
    # Batched and alone agree far inside the 1e-4 goal (float32 summation order only).
    print(f"largest batched-vs-alone logprob difference: {worst:.3g}")
    assert worst < 1e-5


def test_a_full_cache_queues_then_serves_everything(model_dir):
    small = ModelRunner(str(model_dir), max_num_seqs=4, max_model_len=256)
    engine = Engine(small)
    seen_waiting = []
    engine._on_stats = lambda stats: seen_waiting.append(stats.waiting_requests)
    engine.start()
    try:
        requests = _requests(model_dir, 12)
        alone = [run(engine, [params])[0] for params in requests[:3]]
        sinks = run(engine, requests)
    finally:
        engine.stop()
    assert max(seen_waiting) > 0, "12 requests on 4 slots must have waited"
    assert all(s.error is None for s in sinks)
    assert [len(s.token_ids) for s in sinks] == [p.max_tokens for p in requests]
    for one, many in zip(alone, sinks, strict=False):
        assert many.token_ids == one.token_ids
    assert engine.stats.active_sequences == 0 and engine.stats.waiting_requests == 0


def test_cancelling_frees_slots_for_waiting_requests(model_dir):
    small = ModelRunner(str(model_dir), max_num_seqs=2, max_model_len=256)
    engine = Engine(small)
    engine.start()
    try:
        long = GenerationParams(prompt_ids=[1, 2, 3], max_tokens=200, ignore_eos=True)
        short = GenerationParams(prompt_ids=[4, 5], max_tokens=6, temperature=0.0)
        sinks = [
            RecordingSink(cancel_after=3),
            RecordingSink(cancel_after=5),
            RecordingSink(),
            RecordingSink(),
        ]
        run(engine, [long, long, short, short], sinks)
    finally:
        engine.stop()
    assert sinks[0].kind == sinks[1].kind == CANCELLED
    assert len(sinks[0].token_ids) < 10 and len(sinks[1].token_ids) < 10
    assert [len(s.token_ids) for s in sinks[2:]] == [6, 6]
    assert sinks[2].token_ids == sinks[3].token_ids
    assert engine.stats.cancelled_requests == 2
    assert engine.stats.active_sequences == 0


def test_a_full_queue_refuses_with_server_busy(model_dir):
    """Free slots count as room: a burst of max_num_seqs + max_queue_size requests on an idle
    engine is accepted (nothing runs the engine here, so they stay queued), one more is not."""
    engine = Engine(ModelRunner(str(model_dir), max_num_seqs=4, max_model_len=64), max_queue_size=2)
    queued = [RecordingSink() for _ in range(6)]
    for sink in queued:
        engine.submit(GenerationParams(prompt_ids=[1]), sink)
    refused = RecordingSink()
    engine.submit(GenerationParams(prompt_ids=[1]), refused)
    assert refused.kind == BUSY and "server busy: 6 requests are waiting" in refused.error
    assert not any(sink.done.is_set() for sink in queued)
    engine.stop()
    assert all(sink.kind == BUSY and "shutting down" in sink.error for sink in queued)


class LeavingSink(RecordingSink):
    """A client that leaves when the test says so."""

    left = False

    def is_cancelled(self) -> bool:
        return self.left


def test_a_request_counts_as_queued_or_active_never_both_while_it_starts(model_dir):
    """One slot, a queue of one: while the first request starts (its first token out, the
    stats published), one more request fits and a third does not. Counted in both places for
    a moment, it refused the second; counted in neither, it took the third."""
    engine = Engine(ModelRunner(str(model_dir), max_num_seqs=1, max_model_len=64), max_queue_size=1)
    running, queued, refused = LeavingSink(), RecordingSink(), RecordingSink()
    long = GenerationParams(prompt_ids=[1, 2], max_tokens=50, ignore_eos=True)
    short = GenerationParams(prompt_ids=[1, 2], max_tokens=2, ignore_eos=True)

    def submit_once_it_streams(_) -> None:  # on the engine thread, at each publish
        if running.outputs and not queued.outputs and queued.error is None and not submitted:
            submitted.append(True)
            engine.submit(short, queued)
            engine.submit(short, refused)

    submitted: list[bool] = []
    engine._on_stats = submit_once_it_streams
    engine.submit(long, running)
    engine.start()
    try:
        assert refused.done.wait(60)
        assert refused.kind == BUSY and "server busy: 1 requests are waiting" in refused.error
        running.left = True  # frees the slot for the queued one
        assert queued.done.wait(60) and running.done.wait(60)
    finally:
        engine.stop()
    assert (queued.error, len(queued.token_ids)) == (None, 2)
    assert running.kind == CANCELLED


def test_a_waiting_request_whose_client_left_ends_at_once(model_dir):
    """It neither waits for a slot to free nor keeps its place in the queue (vLLM aborts it
    too); wake-ups from finished compiles are not counted as waiting. One iteration's
    admission at a time, the engine thread not started."""
    engine = Engine(ModelRunner(str(model_dir), max_num_seqs=1, max_model_len=64), max_queue_size=3)
    long = GenerationParams(prompt_ids=[1, 2], max_tokens=50, ignore_eos=True)
    running, leaving, waiting, later = (
        RecordingSink(),
        LeavingSink(),
        RecordingSink(),
        RecordingSink(),
    )
    for sink in (running, leaving, waiting):
        engine.submit(long, sink)
    engine._incoming.put(_WAKE)  # as a compile that ended would
    engine._admit()
    engine._publish_stats()
    assert (len(running.outputs), engine.stats.waiting_requests) == (1, 2)
    engine.submit(long, later)
    leaving.left = True
    engine._admit()
    engine._publish_stats()
    assert leaving.kind == CANCELLED and engine.stats.cancelled_requests == 1
    assert engine.stats.waiting_requests == 2  # `waiting` and `later`
    accepted, refused = RecordingSink(), RecordingSink()
    engine.submit(long, accepted)  # the place `leaving` held
    engine.submit(long, refused)
    assert not accepted.done.is_set() and refused.kind == BUSY
    assert not any(sink.done.is_set() for sink in (running, waiting, later))
    engine.stop()


def test_each_admitted_prompt_gets_its_first_token_before_the_next_prefill(
    runner, model_dir, monkeypatch
):
    """A burst of prompts: each one's first token goes out right after its own prefill, not
    after all of theirs (which made a burst of 16 wait for 16 prefills)."""
    events: list[tuple[str, int]] = []
    prefill = runner.prefill

    def recorded_prefill(slot, prompt_ids, all_positions=False):
        events.append(("prefill", slot))
        return prefill(slot, prompt_ids, all_positions=all_positions)

    class FirstTokenSink(RecordingSink):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

        def send(self, output):
            if not self.outputs:
                events.append(("first token", self.index))
            super().send(output)

    monkeypatch.setattr(runner, "prefill", recorded_prefill)
    engine = Engine(runner)
    requests = _requests(model_dir, 4)
    sinks = [FirstTokenSink(i) for i in range(4)]
    for params, sink in zip(requests, sinks, strict=True):
        engine.submit(params, sink)  # all queued before the engine thread runs
    engine.start()
    try:
        for sink in sinks:
            assert sink.done.wait(120), "a request never finished"
    finally:
        engine.stop()
    assert events == [e for i in range(4) for e in (("prefill", i), ("first token", i))]
    solo = Engine(runner)
    solo.start()
    try:
        alone = [run(solo, [params])[0].token_ids for params in requests]
    finally:
        solo.stop()
    assert [s.token_ids for s in sinks] == alone
