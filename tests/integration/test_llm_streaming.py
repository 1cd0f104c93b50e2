"""The `llm` and `ensemble` models on a real tritonserver, through tritonclient gRPC streaming."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from backend import contract
from backend.default_model import PASSAGE
from tests.conftest import TEST_PARAMETERS
from tests.integration.openai_support import assert_generated_since, held, metric, wait_for
from tests.reference import reference_greedy, reference_logprobs, tokenizer
from tests.streaming import Streamer, generate

ATOL = 1e-4
TRUE = np.array([True])  # IGNORE_EOS: unseeded sampling may draw EOS early


def i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def f32(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float32)


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=object)


@pytest.fixture(scope="module")
def passage_ids(model_dir) -> list[int]:
    return tokenizer(model_dir)(PASSAGE)["input_ids"]


@pytest.mark.parametrize("model", ["llm", "ensemble"])
def test_greedy_tokens_equal_transformers_generate(triton_server, model_dir, model):
    prompt = "Triton serves the model"
    prompt_ids = tokenizer(model_dir)(prompt)["input_ids"]
    inputs = {contract.MAX_TOKENS: i32(48), contract.TEMPERATURE: f32(0.0)}
    if model == "llm":
        inputs[contract.INPUT_IDS] = i32(*prompt_ids)
    else:
        inputs[contract.TEXT_INPUT] = text(prompt)
    result = generate(triton_server.grpc_url, model, inputs)
    assert result.error is None
    expected = reference_greedy(model_dir, prompt_ids, 48)
    assert len(expected) == 48
    assert result.token_ids == expected
    assert result.finish_reason == "length"
    # One token or more per response (more when the writer fell behind the engine), counted.
    sizes = [len(r[contract.OUTPUT_IDS]) for r in result.responses]
    assert min(sizes) >= 1
    assert [r[contract.COMPLETION_TOKENS][0] for r in result.responses] == np.cumsum(sizes).tolist()
    last = result.responses[-1]
    assert last[contract.PROMPT_TOKENS][0] == len(prompt_ids)
    assert last[contract.COMPLETION_TOKENS][0] == 48


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_equal_float64_reference(triton_server, model_dir, passage_ids, temperature):
    prompt = passage_ids[:5]
    greedy = reference_greedy(model_dir, prompt, 4)
    # Ids the sampler never picks, a duplicate, an id past the tokenizer (padded vocabulary),
    # and the greedy tokens themselves.
    explicit = [7, 1023, greedy[0], 7, 500, greedy[1]]
    result = generate(
        triton_server.grpc_url,
        "llm",
        {
            contract.INPUT_IDS: i32(*prompt),
            contract.MAX_TOKENS: i32(40),
            contract.TEMPERATURE: f32(temperature),
            contract.SEED: np.array([1234], np.int64),
            contract.LOGPROBS: i32(5),
            contract.LOGPROB_TOKEN_IDS: i32(*explicit),
        },
    )
    assert result.error is None
    tokens = result.token_ids
    ref = reference_logprobs(model_dir, prompt, tokens)
    n = len(tokens)
    assert n == 40
    sampled = result.cat(contract.OUTPUT_LOGPROBS)
    np.testing.assert_allclose(sampled, ref[np.arange(n), tokens], atol=ATOL)
    top_ids = result.cat(contract.TOP_LOGPROB_IDS)
    assert top_ids.shape == (n, 5)
    ref_order = np.argsort(-ref, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(top_ids, ref_order)
    np.testing.assert_allclose(
        result.cat(contract.TOP_LOGPROBS), np.take_along_axis(ref, ref_order, 1), atol=ATOL
    )
    columns = result.cat(contract.LOGPROB_TOKEN_LOGPROBS)
    assert columns.shape == (n, len(explicit))
    np.testing.assert_allclose(columns, ref[:, explicit], atol=ATOL)
    assert np.all(columns <= 0) and np.all(columns > -9999.0)
    # Bytes of the explicit ids come once, on the first response.
    token_bytes = result.responses[0][contract.LOGPROB_TOKEN_BYTES].tolist()
    tok = tokenizer(model_dir)
    assert token_bytes[0] == tok.decode([7]).encode()
    assert token_bytes[1] == b""  # 1023 is a padded id: no token, no bytes
    assert all(len(r[contract.LOGPROB_TOKEN_BYTES]) == 0 for r in result.responses[1:])
    if temperature == 0.0:
        assert tokens[:4] == greedy


def test_seed_reproduces_sampling(triton_server, passage_ids):
    def run(seed: int) -> list[int]:
        inputs = {
            contract.INPUT_IDS: i32(*passage_ids[:3]),
            contract.MAX_TOKENS: i32(24),
            contract.TEMPERATURE: f32(3.0),
            contract.SEED: np.array([seed], np.int64),
        }
        return generate(triton_server.grpc_url, "llm", inputs).token_ids

    first = run(7)
    assert run(7) == first
    assert run(8) != first


def test_four_concurrent_streams_match_each_alone(triton_server, passage_ids):
    cases = [(passage_ids[:3], 30), (passage_ids[10:14], 12), (passage_ids[:1], 45), ([9, 8], 20)]

    def inputs(prompt: list[int], max_tokens: int) -> dict[str, np.ndarray]:
        return {
            contract.INPUT_IDS: i32(*prompt),
            contract.MAX_TOKENS: i32(max_tokens),
            contract.TEMPERATURE: f32(0.0),
            contract.LOGPROBS: i32(2),
            contract.IGNORE_EOS: np.array([True]),
        }

    alone = [generate(triton_server.grpc_url, "llm", inputs(*case)) for case in cases]
    streamers = [Streamer(triton_server.grpc_url) for _ in cases]
    for streamer, case in zip(streamers, cases, strict=True):
        streamer.send("llm", inputs(*case))
    together = [streamer.collect() for streamer in streamers]
    for streamer in streamers:
        streamer.close()
    for one, many, (_, max_tokens) in zip(alone, together, cases, strict=True):
        assert many.error is None
        assert many.token_ids == one.token_ids
        assert len(many.token_ids) == max_tokens
        assert many.text == one.text
        np.testing.assert_allclose(
            many.cat(contract.OUTPUT_LOGPROBS), one.cat(contract.OUTPUT_LOGPROBS), atol=ATOL
        )


def test_cancelled_stream_stops_generating(triton_server, passage_ids):
    cancelled_before = metric(triton_server.metrics_url, "llm_cancelled_requests_total")
    streamer = Streamer(triton_server.grpc_url)
    with held(triton_server):  # it cannot finish before the cancel
        streamer.send(
            "llm",
            {
                contract.INPUT_IDS: i32(*passage_ids[:3]),
                contract.MAX_TOKENS: i32(200),
                contract.IGNORE_EOS: np.array([True]),
            },
        )
        _, error, final = streamer.next()
        assert error is None and not final
        streamer.close(cancel=True)
    assert wait_for(
        lambda: metric(triton_server.metrics_url, "llm_cancelled_requests_total") > cancelled_before
    )
    assert wait_for(lambda: metric(triton_server.metrics_url, "llm_active_sequences") == 0)
    generated = metric(triton_server.metrics_url, "llm_generated_tokens_total")
    finished = metric(triton_server.metrics_url, "llm_finished_requests_total")
    # The server serves the next request, and the cancelled one generated nothing more.
    result = generate(
        triton_server.grpc_url,
        "llm",
        {
            contract.INPUT_IDS: i32(*passage_ids[:3]),
            contract.MAX_TOKENS: i32(5),
            contract.IGNORE_EOS: TRUE,
        },
    )
    assert result.error is None and len(result.token_ids) == 5
    assert_generated_since(triton_server.metrics_url, generated, finished, tokens=5)


def test_a_cancel_request_ends_a_stream_with_its_own_final(triton_server, passage_ids):
    """CANCEL on another stream: one empty final response for it, and the target's stream ends
    with a CANCELLED error that its client reads, nothing cancelled through Triton
    (docs/tensors.md, "Ending a request")."""
    metrics = triton_server.metrics_url
    cancelled_before = metric(metrics, "llm_cancelled_requests_total")
    target, control = Streamer(triton_server.grpc_url), Streamer(triton_server.grpc_url)
    try:
        with held(triton_server):  # it cannot finish before the cancel
            target.send(
                "llm",
                {
                    contract.INPUT_IDS: i32(*passage_ids[:3]),
                    contract.MAX_TOKENS: i32(200),
                    contract.IGNORE_EOS: TRUE,
                },
                request_id="ended-by-cancel",
            )
            first, error, final = target.next()
            assert error is None and not final
            control.send("llm", {contract.CANCEL: TRUE}, "ended-by-cancel", empty_final=True)
            assert control.next() == ({}, None, True)
        result = target.collect()
    finally:
        target.close()
        control.close()
    assert result.error is not None and "cancelled" in result.error
    later = len(result.token_ids) if result.responses else 0
    assert len(first[contract.OUTPUT_IDS]) + later < 200
    assert wait_for(lambda: metric(metrics, "llm_cancelled_requests_total") == cancelled_before + 1)


def test_a_request_cancelled_while_it_waits_for_a_slot_never_starts(triton_server, passage_ids):
    """Its client cancels it while every slot is taken: the writer hears of it from Triton, the
    engine ends it at once, with every slot still taken, and it generates nothing
    (docs/design.md, "Streaming responses", Cancellation)."""
    slots, tokens = int(TEST_PARAMETERS["max_num_seqs"]), 4
    request = {
        contract.INPUT_IDS: i32(*passage_ids[:3]),
        contract.MAX_TOKENS: i32(tokens),
        contract.IGNORE_EOS: TRUE,
    }
    metrics = triton_server.metrics_url
    assert wait_for(lambda: metric(metrics, "llm_active_sequences") == 0)  # every slot is free
    cancelled, generated, finished = (
        metric(metrics, f"llm_{name}_total")
        for name in ("cancelled_requests", "generated_tokens", "finished_requests")
    )
    busy = [Streamer(triton_server.grpc_url) for _ in range(slots)]
    waiting = Streamer(triton_server.grpc_url)
    try:
        with held(triton_server):
            for streamer in busy:  # each holds a slot once it has its first token
                streamer.send("llm", request)
                _, error, final = streamer.next()
                assert error is None and not final
            waiting.send("llm", request, request_id="cancelled-while-waiting")
            # Cancelled once it waits in the engine: a cancel arriving before the request does
            # would end it in Triton, before the model sees it.
            assert wait_for(lambda: metric(metrics, "llm_waiting_requests") == 1)
            waiting.close(cancel=True)
            # Ended while the gate still holds every slot: it keeps no place in the queue.
            assert wait_for(
                lambda: metric(metrics, "llm_cancelled_requests_total") == cancelled + 1
            )
            assert wait_for(lambda: metric(metrics, "llm_waiting_requests") == 0)
        results = [streamer.collect() for streamer in busy]
    finally:
        for streamer in busy:
            streamer.close()
        waiting.close(cancel=True)  # again, if the test failed before it did
    assert all(r.error is None and len(r.token_ids) == tokens - 1 for r in results)
    assert wait_for(lambda: metric(metrics, "llm_finished_requests_total") == finished + slots)
    assert metric(metrics, "llm_generated_tokens_total") == generated + slots * tokens
    # The engine logged it before counting it, to tritonserver's log.
    assert "request cancelled-while-waiting cancelled before it started" in triton_server.log_tail(
        lines=10_000
    )


BAD_INPUTS = [
    (
        {contract.INPUT_IDS: i32(1, 2, 5000)},
        "INPUT_IDS: id 5000 is outside the vocabulary [0, 1024)",
    ),
    ({contract.INPUT_IDS: i32(-1)}, "INPUT_IDS: id -1 is outside the vocabulary"),
    ({contract.INPUT_IDS: np.zeros(0, np.int32)}, "INPUT_IDS: the prompt is empty"),
    (
        {contract.INPUT_IDS: i32(*range(300))},
        "INPUT_IDS: the prompt has 300 tokens, this model's maximum context length is 256 tokens",
    ),
    (
        {contract.INPUT_IDS: i32(1), contract.MAX_TOKENS: i32(-1)},
        "MAX_TOKENS: must be >= 0, got -1",
    ),
    ({contract.INPUT_IDS: i32(1), contract.TEMPERATURE: f32(-0.5)}, "TEMPERATURE: must be >= 0"),
    ({contract.INPUT_IDS: i32(1), contract.TOP_P: f32(0.0)}, "TOP_P: must be in (0, 1]"),
    (
        {contract.INPUT_IDS: i32(1), contract.LOGPROBS: i32(21)},
        "LOGPROBS: must be in [0, 20], got 21",
    ),
    (
        {contract.INPUT_IDS: i32(1), contract.LOGPROB_TOKEN_IDS: i32(3, 1024)},
        "LOGPROB_TOKEN_IDS: id 1024 is outside the vocabulary [0, 1024)",
    ),
    (
        {contract.INPUT_IDS: i32(1), contract.LOGPROB_TOKEN_IDS: np.zeros(0, np.int32)},
        "LOGPROB_TOKEN_IDS: must not be empty",
    ),
    (
        {contract.INPUT_IDS: i32(1), contract.LOGPROB_TOKEN_IDS: i32(*([1] * 1025))},
        "LOGPROB_TOKEN_IDS: 1025 ids requested, at most 1024 are allowed",
    ),
    (
        {contract.INPUT_IDS: i32(1), contract.STOP: np.array([b"\xff\xfe"], dtype=object)},
        "STOP: is not valid UTF-8",
    ),
    # Checked by Triton itself against config.pbtxt, before the model sees them.
    (
        {contract.INPUT_IDS: np.array([1.0], np.float32)},
        "data-type is 'FP32', but model 'llm' expects",
    ),
    (
        {contract.INPUT_IDS: i32(1), contract.MAX_TOKENS: i32(1, 2)},
        "unexpected shape for input 'MAX_TOKENS'",
    ),
]


@pytest.mark.parametrize(("inputs", "message"), BAD_INPUTS)
def test_bad_input_is_refused_and_the_next_request_succeeds(triton_server, inputs, message):
    streamer = Streamer(triton_server.grpc_url)
    try:
        bad = streamer.run("llm", inputs)
        assert bad.error is not None and message in bad.error
        good = streamer.run(
            "llm",
            {contract.INPUT_IDS: i32(1, 2), contract.MAX_TOKENS: i32(3), contract.IGNORE_EOS: TRUE},
        )
        assert good.error is None and len(good.token_ids) == 3
    finally:
        streamer.close()


def test_bad_input_status_is_invalid_arg(triton_server):
    """Over HTTP the status is visible: INVALID_ARG is 400 (gRPC streams carry only the text)."""
    request = urllib.request.Request(
        f"{triton_server.http_url}/v2/models/llm/generate_stream",
        data=b'{"INPUT_IDS": [1, 2, 5000]}',
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 400
    assert b"outside the vocabulary" in caught.value.read()


def test_bad_chat_messages_are_refused(triton_server):
    result = generate(triton_server.grpc_url, "ensemble", {contract.MESSAGES: text("not json")})
    assert result.error is not None and "MESSAGES: is not valid JSON" in result.error


def test_chat_template_kwargs_reach_preprocessing_through_the_ensemble(triton_server):
    """Wired through the ensemble to `preprocessing`: a valid object is taken (the test model's
    template reads no such variable, so it is dropped), a bad one is refused by name."""
    messages = text('[{"role": "user", "content": "Hi"}]')
    ok = generate(
        triton_server.grpc_url,
        "ensemble",
        {
            contract.MESSAGES: messages,
            contract.CHAT_TEMPLATE_KWARGS: text('{"enable_thinking": false}'),
            contract.MAX_TOKENS: i32(2),
        },
    )
    assert ok.error is None and len(ok.token_ids) == 2
    bad = generate(
        triton_server.grpc_url,
        "ensemble",
        {contract.MESSAGES: messages, contract.CHAT_TEMPLATE_KWARGS: text("[1]")},
    )
    assert bad.error is not None and "CHAT_TEMPLATE_KWARGS: must be a JSON object" in bad.error


def test_an_empty_text_through_the_ensemble_names_text_input(triton_server):
    """The test tokenizer adds no BOS, so "" reaches `llm` as no ids; the client sent only
    TEXT_INPUT, and the error must name it."""
    result = generate(triton_server.grpc_url, "ensemble", {contract.TEXT_INPUT: text("")})
    assert result.error is not None
    assert "INPUT_IDS: the prompt is empty" in result.error
    assert "TEXT_INPUT gave no token ids" in result.error


def test_utf8_streaming_never_splits_a_character(triton_server, model_dir):
    """The passage's emoji and CJK characters span several byte tokens; each must arrive whole."""
    start = PASSAGE.index(" 你好")  # a word boundary: the prompt tokenizes as in the passage
    prompt, rest = PASSAGE[:start], PASSAGE[start:]
    result = generate(
        triton_server.grpc_url,
        "ensemble",
        {
            contract.TEXT_INPUT: text(prompt),
            contract.MAX_TOKENS: i32(200),
            contract.TEMPERATURE: f32(0.0),
        },
    )
    assert result.error is None and result.finish_reason == "stop"
    pieces = [r[contract.TEXT_OUTPUT][0].decode() for r in result.responses]
    joined = "".join(pieces)
    assert joined == rest  # the model has the passage by heart; EOS ends it
    assert "\ufffd" not in joined
    assert joined == tokenizer(model_dir).decode(result.token_ids, skip_special_tokens=True)
    token_bytes = result.cat(contract.OUTPUT_TOKEN_BYTES).tolist()
    split = [b for b in token_bytes if b and not _is_utf8(b)]
    assert split, "the test needs characters split across tokens"
    assert any(piece == "" for piece in pieces[:-1])  # held back until the character completes


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_eos_ends_with_stop_and_no_text(triton_server, model_dir, passage_ids):
    result = generate(
        triton_server.grpc_url,
        "llm",
        {
            contract.INPUT_IDS: i32(*passage_ids[:-3]),
            contract.MAX_TOKENS: i32(50),
            contract.TEMPERATURE: f32(0.0),
        },
    )
    assert (result.finish_reason, result.stop_reason) == ("stop", None)
    assert result.token_ids == [*passage_ids[-3:], tokenizer(model_dir).eos_token_id]
    assert result.text == tokenizer(model_dir).decode(passage_ids[-3:])


def test_ignore_eos_generates_past_it(triton_server, passage_ids):
    result = generate(
        triton_server.grpc_url,
        "llm",
        {
            contract.INPUT_IDS: i32(*passage_ids[:-3]),
            contract.MAX_TOKENS: i32(10),
            contract.TEMPERATURE: f32(0.0),
            contract.IGNORE_EOS: np.array([True]),
        },
    )
    assert result.finish_reason == "length" and len(result.token_ids) == 10


@pytest.mark.parametrize("stops", [["fox"], ["brown fox", "lazy"], ["e q"]])
def test_stop_string_cuts_the_text_before_it(triton_server, model_dir, stops):
    prompt = "日本語のテキストも大丈夫です。"
    rest = PASSAGE[PASSAGE.index(prompt) + len(prompt) :]
    end, _, first = min((rest.index(s) + len(s), i, s) for i, s in enumerate(stops))
    cut = end - len(first)  # the first to end wins, ties in list order
    result = generate(
        triton_server.grpc_url,
        "ensemble",
        {
            contract.TEXT_INPUT: text(PASSAGE[: PASSAGE.index(prompt) + len(prompt)]),
            contract.MAX_TOKENS: i32(100),
            contract.TEMPERATURE: f32(0.0),
            contract.STOP: np.array([s.encode() for s in stops], dtype=object),
        },
    )
    assert (result.finish_reason, result.stop_reason) == ("stop", first)
    assert result.text == rest[:cut]


def test_stop_token_id_ends_generation(triton_server, passage_ids):
    stop_id = passage_ids[8]
    result = generate(
        triton_server.grpc_url,
        "llm",
        {
            contract.INPUT_IDS: i32(*passage_ids[:3]),
            contract.MAX_TOKENS: i32(50),
            contract.TEMPERATURE: f32(0.0),
            contract.STOP_TOKEN_IDS: i32(stop_id),
        },
    )
    assert (result.finish_reason, result.stop_reason) == ("stop", stop_id)
    assert result.token_ids == passage_ids[3:9]


def test_max_tokens_zero_answers_with_one_empty_final(triton_server):
    result = generate(
        triton_server.grpc_url, "llm", {contract.INPUT_IDS: i32(1, 2), contract.MAX_TOKENS: i32(0)}
    )
    assert len(result.responses) == 1
    assert result.token_ids == [] and result.finish_reason == "length"


def test_context_limit_ends_with_length(triton_server):
    result = generate(
        triton_server.grpc_url,
        "llm",
        {
            contract.INPUT_IDS: i32(*([5] * 250)),
            contract.MAX_TOKENS: i32(100),
            contract.IGNORE_EOS: np.array([True]),
        },
    )
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 6  # 250 + 6 = the 256-token context


def test_chat_messages_use_the_chat_template(triton_server, model_dir):
    messages = [{"role": "user", "content": "Triton serves"}]
    tok = tokenizer(model_dir)
    prompt_ids = tok(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    result = generate(
        triton_server.grpc_url,
        "ensemble",
        {
            contract.MESSAGES: text(json.dumps(messages)),
            contract.MAX_TOKENS: i32(8),
            contract.TEMPERATURE: f32(0.0),
        },
    )
    assert result.responses[-1][contract.PROMPT_TOKENS][0] == len(prompt_ids)
    assert result.token_ids == reference_greedy(model_dir, prompt_ids, 8)


def test_many_threads_share_the_server(triton_server, passage_ids):
    """Streams started from several client threads at once all complete."""
    results: list = []

    def worker(n: int) -> None:
        results.append(
            generate(
                triton_server.grpc_url,
                "llm",
                {
                    contract.INPUT_IDS: i32(*passage_ids[:2]),
                    contract.MAX_TOKENS: i32(n),
                    contract.IGNORE_EOS: TRUE,
                },
            )
        )

    threads = [threading.Thread(target=worker, args=(n,)) for n in (3, 9, 17, 5, 11, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(len(r.token_ids) for r in results) == [2, 3, 5, 9, 11, 17]


def test_prompt_logprobs_equal_the_reference_at_every_position(triton_server, model_dir):
    prompt = tokenizer(model_dir)("Triton serves the model and streams")["input_ids"]
    labels = [5, 300, 999, 5]
    for max_tokens in (0, 3):
        result = generate(
            triton_server.grpc_url,
            "llm",
            {
                contract.INPUT_IDS: i32(*prompt),
                contract.MAX_TOKENS: i32(max_tokens),
                contract.TEMPERATURE: f32(0.0),
                contract.PROMPT_LOGPROBS: i32(2),
                contract.PROMPT_LOGPROB_TOKEN_IDS: i32(*labels),
            },
        )
        assert result.error is None
        first = result.responses[0]
        ref = reference_logprobs(model_dir, prompt[:1], prompt[1:])  # position i scores token i
        assert first[contract.PROMPT_IDS].tolist() == prompt
        assert first[contract.PROMPT_TOKEN_BYTES].tolist() == [
            tokenizer(model_dir).decode([t]).encode() for t in prompt
        ]
        np.testing.assert_allclose(
            first[contract.PROMPT_TOKEN_LOGPROBS],
            ref[np.arange(len(prompt) - 1), prompt[1:]],
            atol=ATOL,
        )
        order = np.argsort(-ref, axis=1, kind="stable")[:, :2]
        np.testing.assert_array_equal(first[contract.PROMPT_TOP_LOGPROB_IDS], order)
        np.testing.assert_allclose(
            first[contract.PROMPT_TOP_LOGPROBS], np.take_along_axis(ref, order, 1), atol=ATOL
        )
        np.testing.assert_allclose(
            first[contract.PROMPT_LOGPROB_TOKEN_LOGPROBS], ref[:, labels], atol=ATOL
        )
        assert len(result.token_ids) == max_tokens
        for later in result.responses[1:]:
            assert (
                later[contract.PROMPT_IDS].size == 0
                and later[contract.PROMPT_TOKEN_LOGPROBS].size == 0
            )


def test_logit_bias_changes_sampling_not_the_reported_logprob(
    triton_server, model_dir, passage_ids
):
    target = 777
    result = generate(
        triton_server.grpc_url,
        "llm",
        {
            contract.INPUT_IDS: i32(*passage_ids[:4]),
            contract.MAX_TOKENS: i32(3),
            contract.TEMPERATURE: f32(0.0),
            contract.LOGPROBS: i32(0),
            contract.LOGIT_BIAS_IDS: i32(target),
            contract.LOGIT_BIAS_VALUES: np.array([100.0], np.float32),
        },
    )
    assert result.token_ids == [target] * 3
    ref = reference_logprobs(model_dir, passage_ids[:4], result.token_ids)
    np.testing.assert_allclose(result.cat(contract.OUTPUT_LOGPROBS), ref[:, target], atol=ATOL)
    assert np.all(result.cat(contract.OUTPUT_LOGPROBS) < -1.0)  # raw: the model itself dislikes it


def test_allowed_token_ids_restrict_sampling(triton_server, passage_ids):
    allowed = [11, 12, 13]
    result = generate(
        triton_server.grpc_url,
        "llm",
        {
            contract.INPUT_IDS: i32(*passage_ids[:4]),
            contract.MAX_TOKENS: i32(30),
            contract.TEMPERATURE: f32(1.0),
            contract.SEED: np.array([3], np.int64),
            contract.ALLOWED_TOKEN_IDS: i32(*allowed),
        },
    )
    assert set(result.token_ids) <= set(allowed)
    assert len(set(result.token_ids)) > 1


def test_penalties_reduce_repetition(triton_server):
    """The random part of the model repeats itself on a repetitive prompt; penalties fight it."""
    prompt = [40, 41] * 20

    def distinct(**penalties: float) -> int:
        inputs = {
            contract.INPUT_IDS: i32(*prompt),
            contract.MAX_TOKENS: i32(40),
            contract.TEMPERATURE: f32(0.0),
            contract.IGNORE_EOS: np.array([True]),
        }
        inputs.update({name: f32(value) for name, value in penalties.items()})
        return len(set(generate(triton_server.grpc_url, "llm", inputs).token_ids))

    plain = distinct()
    assert distinct(**{contract.FREQUENCY_PENALTY: 2.0}) > plain
    assert distinct(**{contract.PRESENCE_PENALTY: 2.0}) > plain
    assert distinct(**{contract.REPETITION_PENALTY: 3.0}) > plain


def test_min_tokens_holds_back_eos(triton_server, model_dir, passage_ids):
    inputs = {
        contract.INPUT_IDS: i32(*passage_ids[:-2]),
        contract.MAX_TOKENS: i32(10),
        contract.TEMPERATURE: f32(0.0),
    }
    assert len(generate(triton_server.grpc_url, "llm", inputs).token_ids) == 3  # 2 + EOS
    result = generate(triton_server.grpc_url, "llm", {**inputs, contract.MIN_TOKENS: i32(6)})
    assert len(result.token_ids) >= 6
    assert tokenizer(model_dir).eos_token_id not in result.token_ids[:5]


def test_include_stop_str_in_output(triton_server):
    prompt = "日本語のテキストも大丈夫です。"
    head = PASSAGE[: PASSAGE.index(prompt) + len(prompt)]
    result = generate(
        triton_server.grpc_url,
        "ensemble",
        {
            contract.TEXT_INPUT: text(head),
            contract.MAX_TOKENS: i32(100),
            contract.TEMPERATURE: f32(0.0),
            contract.STOP: np.array([b"fox"], dtype=object),
            contract.INCLUDE_STOP_STR_IN_OUTPUT: np.array([True]),
        },
    )
    assert result.finish_reason == "stop"
    assert result.text == " The quick brown fox"


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({contract.PRESENCE_PENALTY: f32(3.0)}, "PRESENCE_PENALTY: must be in [-2, 2]"),
        ({contract.REPETITION_PENALTY: f32(0.0)}, "REPETITION_PENALTY: must be > 0"),
        (
            {
                contract.LOGIT_BIAS_IDS: i32(1, 2),
                contract.LOGIT_BIAS_VALUES: np.array([1.0], np.float32),
            },
            "LOGIT_BIAS_VALUES: has 1 values for 2 ids",
        ),
        (
            {
                contract.LOGIT_BIAS_IDS: i32(1),
                contract.LOGIT_BIAS_VALUES: np.array([101.0], np.float32),
            },
            "LOGIT_BIAS_VALUES: each bias must be in [-100, 100]",
        ),
        ({contract.ALLOWED_TOKEN_IDS: i32(5000)}, "ALLOWED_TOKEN_IDS: id 5000 is outside"),
        ({contract.MIN_TOKENS: i32(50)}, "MIN_TOKENS: must be in [0, MAX_TOKENS=16], got 50"),
        ({contract.PROMPT_LOGPROBS: i32(21)}, "PROMPT_LOGPROBS: must be in [0, 20]"),
        (
            {contract.PROMPT_LOGPROB_TOKEN_IDS: i32(-3)},
            "PROMPT_LOGPROB_TOKEN_IDS: id -3 is outside",
        ),
    ],
)
def test_bad_sampling_inputs_are_refused(triton_server, inputs, message):
    result = generate(triton_server.grpc_url, "llm", {contract.INPUT_IDS: i32(1, 2), **inputs})
    assert result.error is not None and message in result.error
