"""Engine on the real ModelRunner: rows with different logprob requests share one step and each
gets exactly its own shapes and values (vLLM once returned padding to plain top-k rows batched
with explicit-id rows)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from backend import contract
from backend import triton_io as io
from backend.engine import Engine, EngineStats
from backend.model_runner import ModelRunner
from backend.outputs import BUSY, CANCELLED, INTERNAL, INVALID
from backend.params import GenerationParams
from backend.stopping import LENGTH
from backend.token_bytes import token_bytes_table
from tests.reference import reference_logprobs, tokenizer
from tests.sinks import RecordingSink

WAIT_S = 60.0
ATOL = 1e-4


@pytest.fixture
def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(str(model_dir), max_num_seqs=8, max_model_len=256)


@pytest.fixture
def stats() -> list[EngineStats]:
    return []


@pytest.fixture
def engine(runner: ModelRunner, stats: list[EngineStats]) -> Iterator[Engine]:
    def record(s: EngineStats) -> None:
        stats.append(EngineStats(**vars(s)))

    engine = Engine(runner, on_stats=record)
    yield engine
    engine.stop()


def run(engine: Engine, requests: list[GenerationParams]) -> list[RecordingSink]:
    """Queue every request before the loop starts, so the first step admits them all."""
    sinks = [RecordingSink() for _ in requests]
    for params, sink in zip(requests, sinks, strict=True):
        engine.submit(params, sink)
    engine.start()
    for sink in sinks:
        assert sink.done.wait(WAIT_S)
    return sinks


# (natural top-k `logprobs`, explicit ids): every combination, and different k and M per row.
ROWS: list[tuple[int | None, list[int]]] = [
    (None, []),  # no logprobs
    (0, []),  # only the sampled token's
    (2, []),  # top-k only
    (5, []),  # a larger top-k in the same batch
    (None, [7, 1003, 7, 42]),  # explicit ids only (a padding id, a duplicate)
    (3, [0, 999]),  # both
]
STEPS = 3


def test_each_row_of_a_mixed_batch_gets_exactly_its_own_logprobs(
    engine: Engine, model_dir: Path, passage: list[int], stats: list[EngineStats]
) -> None:
    requests = [
        GenerationParams(
            prompt_ids=passage[: 4 + 2 * row],  # a different prompt per row
            max_tokens=STEPS,
            temperature=0.0,
            ignore_eos=True,
            logprobs=logprobs,
            logprob_token_ids=ids,
        )
        for row, (logprobs, ids) in enumerate(ROWS)
    ]
    sinks = run(engine, requests)
    # All rows admitted in the first iteration (stats go after each admission), so they share
    # its step.
    assert [s.active_sequences for s in stats[: len(ROWS)]] == list(range(1, len(ROWS) + 1))
    assert stats[len(ROWS) - 1].generated_tokens == len(ROWS)
    table = token_bytes_table(tokenizer(model_dir), 1024)

    for params, sink in zip(requests, sinks, strict=True):
        assert sink.error is None
        assert len(sink.outputs) == STEPS
        k = params.logprobs or 0
        ids = params.logprob_token_ids
        m = len(ids)
        tokens = [t for out in sink.outputs for t in out.token_ids]
        ref = reference_logprobs(model_dir, params.prompt_ids, tokens)
        for step, out in enumerate(sink.outputs):
            row_ref = ref[step]
            assert out.token_ids == [int(row_ref.argmax())]  # greedy
            assert out.top_ids.shape == (1, k)
            assert out.top_logprobs.shape == (1, k)
            assert out.token_id_logprobs.shape == (1, m)
            assert len(out.top_bytes) == k
            if k:
                expected_top = np.argsort(-row_ref, kind="stable")[:k]
                assert out.top_ids[0].tolist() == expected_top.tolist()
                np.testing.assert_allclose(out.top_logprobs[0], row_ref[expected_top], atol=ATOL)
                assert out.top_bytes == [table[i] for i in expected_top]
            if m:
                np.testing.assert_allclose(out.token_id_logprobs[0], row_ref[ids], atol=ATOL)
            if params.logprobs is not None:
                np.testing.assert_allclose(out.logprobs, row_ref[out.token_ids], atol=ATOL)
            # Explicit ids' bytes once, on the first response.
            assert out.token_id_bytes == ([table[i] for i in ids] if step == 0 else [])

            # And the response tensors carry exactly these shapes.
            arrays = io.output_arrays(out, params)
            assert arrays[contract.OUTPUT_LOGPROBS].shape == (
                (1,) if params.logprobs is not None else (0,)
            )
            assert arrays[contract.TOP_LOGPROB_IDS].shape == (1, k)
            assert arrays[contract.TOP_LOGPROB_TOKEN_BYTES].shape == (1, k)
            assert arrays[contract.LOGPROB_TOKEN_LOGPROBS].shape == (1, m)
            assert arrays[contract.LOGPROB_TOKEN_BYTES].shape == ((m,) if step == 0 else (0,))
        assert sink.outputs[-1].finish_reason == LENGTH


def test_max_tokens_zero_answers_once_with_empty_rows_of_the_asked_width(
    engine: Engine, model_dir: Path
) -> None:
    params = GenerationParams(prompt_ids=[5, 6], max_tokens=0, logprobs=4, logprob_token_ids=[1, 2])
    [sink] = run(engine, [params])
    [out] = sink.outputs
    assert (out.token_ids, out.text, out.finish_reason) == ([], "", LENGTH)
    assert out.top_ids.shape == (0, 4)
    assert out.token_id_logprobs.shape == (0, 2)
    table = token_bytes_table(tokenizer(model_dir), 1024)
    assert out.token_id_bytes == [table[1], table[2]]
    assert (out.prompt_tokens, out.completion_tokens) == (2, 0)


@pytest.mark.parametrize(
    ("grammar", "min_tokens", "allowed", "message"),
    [
        # A grammar alone bans every id where the vocabulary cannot spell what it needs.
        (
            True,
            0,
            [],
            f"{contract.STRUCTURED_OUTPUT}: no token fits: "
            f"{contract.STRUCTURED_OUTPUT} bans every id",
        ),
        (
            True,
            3,
            [5],
            f"{contract.STRUCTURED_OUTPUT}: no token fits: "
            f"{contract.STRUCTURED_OUTPUT}, {contract.MIN_TOKENS} and {contract.ALLOWED_TOKEN_IDS} "
            "together ban every id",
        ),
        # No input bans: the model's logits were all -inf (a review: it raised, failing the
        # whole batch).
        (False, 0, [], "internal error: no token fits: every logit is -inf"),
    ],
)
def test_no_token_fits_names_only_the_inputs_that_ban(
    grammar: bool, min_tokens: int, allowed: list[int], message: str
) -> None:
    params = GenerationParams(prompt_ids=[1], min_tokens=min_tokens, allowed_token_ids=allowed)
    seq = SimpleNamespace(matcher=object() if grammar else None, generated=0, params=params)
    kind = INVALID if grammar or min_tokens or allowed else INTERNAL
    assert Engine._no_token_fits(seq) == (message, kind)  # type: ignore[arg-type]


def test_allowed_ids_that_min_tokens_all_bans_are_invalid(
    engine: Engine, runner: ModelRunner
) -> None:
    """Only EOS allowed, and MIN_TOKENS bans it: an error, not EOS as a row of -inf's argmax."""
    [eos] = sorted(runner.eos_ids)[:1]
    params = GenerationParams(
        prompt_ids=[5, 6], max_tokens=5, min_tokens=3, allowed_token_ids=[eos]
    )
    [sink] = run(engine, [params])
    assert sink.kind == INVALID
    assert sink.error == (
        f"{contract.MIN_TOKENS}: no token fits: {contract.MIN_TOKENS} and "
        f"{contract.ALLOWED_TOKEN_IDS} together ban every id"
    )
    assert sink.token_ids == []


def test_stop_strings_count_only_once_the_output_exceeds_min_tokens(
    engine: Engine, passage: list[int]
) -> None:
    """As vLLM: a space in the first 20 tokens' text does not stop a request with min_tokens
    20; the first one in a later token's text does, cut there."""
    greedy = GenerationParams(
        prompt_ids=passage[:5], max_tokens=40, temperature=0.0, ignore_eos=True
    )
    [free] = run(engine, [greedy])
    texts = [out.text for out in free.outputs]
    text, first_20 = "".join(texts), len("".join(texts[:20]))
    assert " " in text[:first_20] and " " in text[first_20:]
    held = replace(greedy, min_tokens=20, stop=[" "])
    sink = RecordingSink()
    engine.submit(held, sink)
    assert sink.done.wait(WAIT_S)
    assert sink.outputs[-1].finish_reason == "stop"
    assert "".join(out.text for out in sink.outputs) == text[: text.index(" ", first_20)]
    assert sink.token_ids == free.token_ids[: len(sink.token_ids)]
    assert len(sink.token_ids) > 20


@pytest.mark.parametrize("max_tokens", [0, 2])
def test_a_one_token_prompt_has_empty_prompt_logprob_rows(
    engine: Engine, model_dir: Path, max_tokens: int
) -> None:
    """A prompt's first token has no logprob (`echo` of one token, lm-eval's shortest context):
    zero rows, not an error."""
    params = GenerationParams(
        prompt_ids=[5],
        max_tokens=max_tokens,
        ignore_eos=True,
        prompt_logprobs=3,
        prompt_logprob_token_ids=[1, 2],
    )
    [sink] = run(engine, [params])
    assert sink.error is None
    assert sum(len(out.token_ids) for out in sink.outputs) == max_tokens
    prompt = sink.outputs[0].prompt
    assert prompt is not None
    assert prompt.ids == [5]
    assert prompt.logprobs.shape == (0,)
    assert prompt.top_ids.shape == (0, 3)
    assert prompt.top_logprobs.shape == (0, 3)
    assert prompt.token_id_logprobs.shape == (0, 2)
    table = token_bytes_table(tokenizer(model_dir), 1024)
    assert prompt.token_bytes == [table[5]]
    assert prompt.token_id_bytes == [table[1], table[2]]


def test_a_request_that_fails_to_start_gets_one_error_and_the_others_are_served(
    engine: Engine, runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, passage: list[int]
) -> None:
    prefill = runner.prefill

    def failing_prefill(slot: int, prompt_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        if prompt_ids == [13, 13, 13]:  # as out-of-memory would
            raise RuntimeError("injected prefill failure")
        return prefill(slot, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(runner, "prefill", failing_prefill)
    good = GenerationParams(prompt_ids=passage[:5], max_tokens=4, temperature=0.0, ignore_eos=True)
    bad = GenerationParams(prompt_ids=[13, 13, 13], max_tokens=4)
    first, failed, second = run(engine, [good, bad, good])
    assert failed.outputs == []
    assert (failed.error, failed.kind) == ("internal error: injected prefill failure", INTERNAL)
    for sink in (first, second):
        assert sink.error is None
        assert [len(out.token_ids) for out in sink.outputs] == [1] * 4
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]


def test_stop_answers_queued_requests_that_never_started(runner: ModelRunner) -> None:
    engine = Engine(runner)
    sink = RecordingSink()
    engine.submit(GenerationParams(prompt_ids=[1]), sink)
    engine.stop()
    assert sink.outputs == []
    assert (sink.error, sink.kind) == ("the model is shutting down", BUSY)


class EveryCall(RecordingSink):
    """Records every call, also those after the final one (which `RecordingSink` would assert
    on the engine thread, where the loop's handler would swallow it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def send(self, output: Any) -> None:
        self.calls.append("final" if output.finish_reason is not None else "output")
        if not self.done.is_set():
            super().send(output)

    def send_error(self, message: str, *, kind: str = INTERNAL) -> None:
        self.calls.append(f"error {kind}")
        if not self.done.is_set():
            super().send_error(message, kind=kind)


def test_stop_during_a_step_longer_than_its_wait_ends_each_request_once_after_the_step(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, passage: list[int]
) -> None:
    in_step, release = threading.Event(), threading.Event()
    decode = runner.decode

    def slow_decode(*args: Any, **kwargs: Any) -> Any:
        in_step.set()
        assert release.wait(WAIT_S)
        return decode(*args, **kwargs)

    monkeypatch.setattr(runner, "decode", slow_decode)
    engine = Engine(runner)
    running, queued = EveryCall(), EveryCall()
    params = GenerationParams(prompt_ids=passage[:5], max_tokens=50, ignore_eos=True)
    engine.submit(params, running)
    engine.start()
    assert in_step.wait(WAIT_S)
    engine.submit(params, queued)  # taken from the queue only after the step
    engine.stop(timeout_s=0.01)
    assert running.calls == ["output"] and queued.calls == []  # nothing ended under the step
    release.set()
    assert running.done.wait(WAIT_S) and queued.done.wait(WAIT_S)
    assert engine._thread is not None
    engine._thread.join(WAIT_S)
    assert running.calls[-1] == f"error {BUSY}"  # its only end, after what the step sent
    assert set(running.calls[:-1]) == {"output"}
    assert queued.calls == [f"error {BUSY}"]
    late = EveryCall()
    engine.submit(params, late)
    assert (late.calls, late.error) == ([f"error {BUSY}"], "the model is shutting down")


class CancelledOnceAdmitted(RecordingSink):
    """Not cancelled when the engine admits it (its first `is_cancelled`), cancelled after."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def is_cancelled(self) -> bool:
        self.checks += 1
        return self.checks > 1


def test_a_request_cancelled_at_admission_gets_its_first_token_then_the_cancel(
    engine: Engine, passage: list[int]
) -> None:
    """A step's outputs wait for its logprobs, gathered beside the next forward; a cancel seen
    in the iteration that admitted a request must not overtake its first token."""
    params = GenerationParams(
        prompt_ids=passage[:5], max_tokens=50, temperature=0.0, logprob_token_ids=[3, 9]
    )
    other = GenerationParams(prompt_ids=passage[:5], max_tokens=3, temperature=0.0)
    cancelled, finished = CancelledOnceAdmitted(), RecordingSink()
    for request, sink in ((params, cancelled), (other, finished)):
        engine.submit(request, sink)
    engine.start()
    for sink in (cancelled, finished):
        assert sink.done.wait(WAIT_S)
    assert [len(out.token_ids) for out in cancelled.outputs] == [1]
    assert cancelled.outputs[0].token_id_logprobs.shape == (1, 2)
    assert cancelled.kind == CANCELLED
    assert finished.error is None and len(finished.token_ids) == 3


def test_a_request_cancelled_before_it_started_gets_only_the_cancel(
    engine: Engine, passage: list[int]
) -> None:
    """Its client left while it waited for a slot: no prefill, no token, and the request
    beside it is untouched."""
    params = GenerationParams(prompt_ids=passage[:5], max_tokens=3, temperature=0.0)
    waiting, other = RecordingSink(cancel_after=0), RecordingSink()
    for sink in (waiting, other):
        engine.submit(params, sink)
    engine.start()
    for sink in (waiting, other):
        assert sink.done.wait(WAIT_S)
    assert waiting.outputs == [] and waiting.kind == CANCELLED
    assert other.error is None and len(other.token_ids) == 3
    assert (engine.stats.cancelled_requests, engine.stats.generated_tokens) == (1, 3)


def test_min_tokens_bans_eos_also_when_eos_is_ignored(
    engine: Engine, runner: ModelRunner, passage: list[int]
) -> None:
    """vLLM's MinTokensLogitsProcessor bans EOS whatever `ignore_eos`: the first `min_tokens`
    tokens are those of the same request that stops at EOS (the passage's end, where the test
    model says EOS)."""
    greedy = GenerationParams(
        prompt_ids=passage[:-3], max_tokens=12, temperature=0.0, ignore_eos=True
    )
    free, held, stopping = run(
        engine,
        [greedy, replace(greedy, min_tokens=9), replace(greedy, min_tokens=9, ignore_eos=False)],
    )
    first_eos = next(i for i, t in enumerate(free.token_ids) if t in runner.eos_ids)
    assert first_eos < 8  # unbanned, greedy says EOS within the first 9
    assert not runner.eos_ids & set(held.token_ids[:9])
    assert held.token_ids[:9] == stopping.token_ids[:9]


def test_a_stop_string_in_a_stop_token_s_own_text_cuts_it(
    engine: Engine, passage: list[int], model_dir: Path
) -> None:
    """With include_stop_str_in_output the stop token's text is searched too, and a stop
    string ending inside it cuts the text there and is the stop reason, as in vLLM's
    detokenizer `update` (which skips the token's text only when it is not included)."""
    greedy = GenerationParams(prompt_ids=passage[:5], max_tokens=8, temperature=0.0)
    [free] = run(engine, [greedy])
    stop_id = free.token_ids[3]
    stop_text = tokenizer(model_dir).decode([stop_id]).strip()
    assert len(stop_text) >= 2  # a stop string can end inside it, before its end
    params = replace(
        greedy, stop_token_ids=[stop_id], stop=[stop_text[:-1]], include_stop_str_in_output=True
    )
    sink = RecordingSink()
    engine.submit(params, sink)
    assert sink.done.wait(WAIT_S)
    assert sink.token_ids == free.token_ids[:4]
    texts = [out.text for out in free.outputs[:4]]
    texts[3] = texts[3][: texts[3].index(stop_text) + len(stop_text) - 1]
    assert [out.text for out in sink.outputs] == texts
    assert sink.outputs[-1].stop_reason == stop_text[:-1]


def test_the_final_output_names_the_stop_string_or_id_that_ended_it(
    engine: Engine, runner: ModelRunner, passage: list[int], model_dir: Path
) -> None:
    """vLLM's `stop_reason`: the stop string or stop id (the generation config's EOS ids other
    than the tokenizer's included), None for the tokenizer's EOS and for the limit."""
    greedy = GenerationParams(prompt_ids=passage[:5], max_tokens=8, temperature=0.0)
    [free] = run(engine, [greedy])
    word = tokenizer(model_dir).decode(free.token_ids[2:4]).strip()
    eos = tokenizer(model_dir).eos_token_id
    [other_eos] = runner.eos_ids - {eos}  # the test model's generation config lists two
    cases = [
        (replace(greedy, stop=["\x00", word]), word),
        (replace(greedy, stop_token_ids=[free.token_ids[3]]), free.token_ids[3]),
        (replace(greedy, stop_token_ids=[eos], allowed_token_ids=[eos]), None),  # EOS first
        (replace(greedy, stop_token_ids=[eos], allowed_token_ids=[eos], ignore_eos=True), eos),
        (replace(greedy, allowed_token_ids=[other_eos]), other_eos),  # vLLM: a stop id
        (greedy, None),  # the limit
    ]
    for params, stop_reason in cases:
        sink = RecordingSink()
        engine.submit(params, sink)
        assert sink.done.wait(WAIT_S)
        final = sink.outputs[-1]
        assert (final.finish_reason, final.stop_reason) == (
            "length" if params is greedy else "stop",
            stop_reason,
        ), params
