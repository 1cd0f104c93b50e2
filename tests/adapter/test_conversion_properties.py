"""Hypothesis properties of the conversions around Triton: what the adapter sends is what the
engine parses (through the gRPC tensor encoding), what the engine sends is what the adapter
reads, the logprob entries follow the explicit-id rule, and streamed chunks join to the full
response."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

from adapter.completions.protocol import CompletionRequest
from adapter.completions.serving import CompletionChoiceBuilder
from adapter.logprobs import LogprobsCollector
from adapter.tensors import TritonOutput, TritonRequest, llm_inputs, to_infer_inputs
from backend import contract
from backend import triton_io as io
from backend.outputs import PromptLogprobs, StepOutput, merge_outputs
from backend.params import EngineLimits, GenerationParams
from backend.structured_output import StructuredOutput

VOCAB = 1024
LIMITS = EngineLimits(vocab_size=VOCAB, max_model_len=4096, max_logprobs=20)
PROPERTIES = settings(max_examples=60, deadline=None)

token_ids = st.integers(0, VOCAB - 1)
distinct_ids = st.lists(token_ids, max_size=6, unique=True).map(tuple)
optional = st.none().__or__
# float32 values, as the tensors carry them.
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
logprob = st.floats(max_value=0, width=32, allow_nan=False) | st.just(-math.inf)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-100, 100) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
nonempty_text = st.text(min_size=1, max_size=12)
structured_outputs = st.one_of(
    st.builds(
        StructuredOutput,
        st.just("choice"),
        st.lists(nonempty_text, min_size=1, max_size=4).map(tuple),
        st.booleans(),
    ),
    st.builds(
        StructuredOutput, st.sampled_from(["regex", "grammar"]), nonempty_text, st.booleans()
    ),
    st.builds(StructuredOutput, st.just("json_object"), st.just(""), st.booleans()),
    st.builds(
        StructuredOutput.json_schema,
        st.dictionaries(st.text(max_size=6), json_values, max_size=4) | st.booleans(),
        st.booleans(),
    ),
)


@st.composite
def generation_params(draw: st.DrawFn) -> tuple[TritonRequest, list[int]]:
    max_tokens = draw(optional(st.integers(0, 64)))
    bias_ids = draw(distinct_ids)
    params = TritonRequest(
        max_tokens=max_tokens,
        temperature=draw(optional(st.floats(0, 2, width=32))),
        top_p=draw(optional(st.floats(0, 1, width=32, exclude_min=True))),
        top_k=draw(optional(st.integers(0, 100))),
        min_p=draw(optional(st.floats(0, 1, width=32))),
        seed=draw(optional(st.integers(-(2**63), 2**63 - 1))),
        stop=tuple(draw(st.lists(st.text(min_size=1, max_size=5), max_size=3))),
        stop_token_ids=draw(distinct_ids),
        include_stop_str_in_output=draw(optional(st.booleans())),
        ignore_eos=draw(optional(st.booleans())),
        min_tokens=draw(optional(st.integers(0, 16 if max_tokens is None else max_tokens))),
        presence_penalty=draw(optional(st.floats(-2, 2, width=32))),
        frequency_penalty=draw(optional(st.floats(-2, 2, width=32))),
        repetition_penalty=draw(optional(st.floats(0.125, 10, width=32))),
        logit_bias=tuple((i, draw(st.floats(-100, 100, width=32))) for i in bias_ids),
        allowed_token_ids=draw(distinct_ids),
        logprobs=draw(optional(st.integers(0, 20))),
        logprob_token_ids=draw(distinct_ids),
        prompt_logprobs=draw(optional(st.integers(0, 20))),
        prompt_logprob_token_ids=draw(distinct_ids),
        structured_output=draw(optional(structured_outputs)),
    )
    prompt = draw(st.lists(token_ids, min_size=1, max_size=12))
    return params, prompt


def over_the_wire(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays as Triton decodes them from the gRPC request the adapter builds."""
    decoded = {}
    for tensor in to_infer_inputs(arrays):
        raw = tensor._get_content()
        if tensor.datatype() == "BYTES":
            array = deserialize_bytes_tensor(raw)
        else:
            array = np.frombuffer(raw, dtype=triton_to_np_dtype(tensor.datatype()))
        decoded[tensor.name()] = array.reshape(tensor.shape())
    return decoded


def f32_value(value: float | None, default: float) -> float:
    return default if value is None else float(np.float32(value))


@PROPERTIES
@given(generation_params())
def test_the_engine_parses_what_the_adapter_sends(drawn) -> None:
    params, prompt = drawn
    parsed = io.parse_request(over_the_wire(llm_inputs(params, prompt)), LIMITS, "r")
    defaults = GenerationParams(prompt_ids=prompt)
    assert parsed.prompt_ids == prompt
    assert parsed.max_tokens == (
        defaults.max_tokens if params.max_tokens is None else params.max_tokens
    )
    assert parsed.temperature == f32_value(params.temperature, defaults.temperature)
    assert parsed.top_p == f32_value(params.top_p, defaults.top_p)
    assert parsed.top_k == (params.top_k or 0)
    assert parsed.min_p == f32_value(params.min_p, defaults.min_p)
    assert parsed.seed == params.seed
    assert parsed.stop == list(params.stop)
    assert parsed.stop_token_ids == list(params.stop_token_ids)
    assert parsed.include_stop_str_in_output == bool(params.include_stop_str_in_output)
    assert parsed.ignore_eos == bool(params.ignore_eos)
    assert parsed.min_tokens == (params.min_tokens or 0)
    assert parsed.presence_penalty == f32_value(params.presence_penalty, 0.0)
    assert parsed.frequency_penalty == f32_value(params.frequency_penalty, 0.0)
    assert parsed.repetition_penalty == f32_value(params.repetition_penalty, 1.0)
    assert parsed.logit_bias == {i: f32_value(b, 0.0) for i, b in params.logit_bias}
    assert parsed.allowed_token_ids == list(params.allowed_token_ids)
    assert parsed.logprobs == params.logprobs
    assert parsed.logprob_token_ids == list(params.logprob_token_ids)
    assert parsed.prompt_logprobs == params.prompt_logprobs
    assert parsed.prompt_logprob_token_ids == list(params.prompt_logprob_token_ids)
    assert parsed.structured_output == params.structured_output


@st.composite
def step_outputs(draw: st.DrawFn) -> tuple[StepOutput, GenerationParams]:
    """One engine response and the params it answers (k natural, M explicit columns); with
    explicit ids the adapter always sends LOGPROBS too (0 when no natural top-k)."""
    n = draw(st.integers(0, 3))
    explicit = list(draw(distinct_ids))
    m = len(explicit)
    k = draw(st.integers(0, 3) if m else optional(st.integers(0, 3)))
    ids = draw(st.lists(token_ids, min_size=n, max_size=n))
    raw = st.binary(min_size=1, max_size=4)
    prompt = None
    prompt_k = draw(optional(st.integers(0, 2)))
    prompt_explicit: list[int] = []
    if prompt_k is not None:
        rows = draw(st.integers(0, 3))
        prompt_explicit = list(draw(distinct_ids))
        pm = len(prompt_explicit)
        prompt = PromptLogprobs(
            ids=draw(st.lists(token_ids, min_size=rows + 1, max_size=rows + 1)),
            token_bytes=draw(st.lists(raw, min_size=rows + 1, max_size=rows + 1)),
            logprobs=np.array(draw(st.lists(logprob, min_size=rows, max_size=rows))),
            top_ids=np.array(
                draw(st.lists(token_ids, min_size=rows * prompt_k, max_size=rows * prompt_k))
            ),
            top_logprobs=np.array(
                draw(st.lists(logprob, min_size=rows * prompt_k, max_size=rows * prompt_k))
            ),
            top_bytes=draw(st.lists(raw, min_size=rows * prompt_k, max_size=rows * prompt_k)),
            token_id_logprobs=np.array(
                draw(st.lists(logprob, min_size=rows * pm, max_size=rows * pm))
            ).reshape(rows, pm),
            token_id_bytes=draw(st.lists(raw, min_size=pm, max_size=pm)),
        )
    kk = k or 0
    out = StepOutput(
        token_ids=ids,
        text=draw(st.text(max_size=6)),
        token_bytes=draw(st.lists(raw, min_size=n, max_size=n)),
        logprobs=np.array(draw(st.lists(logprob, min_size=n, max_size=n))),
        top_ids=np.array(draw(st.lists(token_ids, min_size=n * kk, max_size=n * kk))),
        top_logprobs=np.array(draw(st.lists(logprob, min_size=n * kk, max_size=n * kk))),
        top_bytes=draw(st.lists(raw, min_size=n * kk, max_size=n * kk)),
        token_id_logprobs=np.array(draw(st.lists(logprob, min_size=n * m, max_size=n * m))),
        token_id_bytes=draw(st.lists(raw, min_size=m, max_size=m)),
        finish_reason=draw(st.sampled_from([None, "stop", "length"])),
        prompt_tokens=draw(st.integers(1, 4096)),
        completion_tokens=draw(st.integers(0, 4096)),
        prompt=prompt,
    )
    params = GenerationParams(
        prompt_ids=[1],
        logprobs=k,
        logprob_token_ids=explicit,
        prompt_logprobs=prompt_k,
        prompt_logprob_token_ids=prompt_explicit,
    )
    return out, params


def flat(rows: Iterable[list[Any]]) -> list[Any]:
    return list(itertools.chain.from_iterable(rows))


def sent(values: np.ndarray) -> list[float]:
    """Logprobs as the engine sends them: float32, -inf as -9999."""
    return np.maximum(np.asarray(values, np.float32), contract.NEG_INF_LOGPROB).reshape(-1).tolist()


@PROPERTIES
@given(step_outputs())
def test_the_adapter_reads_what_the_engine_sends(drawn) -> None:
    out, params = drawn
    got = TritonOutput.from_arrays(
        io.output_arrays(out, params), final=out.finish_reason is not None
    )
    n, k, m = len(out.token_ids), params.logprobs or 0, len(params.logprob_token_ids)
    assert got.output_ids == out.token_ids
    assert got.text == out.text
    assert got.token_bytes == out.token_bytes
    assert got.logprobs == (sent(out.logprobs) if params.logprobs is not None else [])
    assert flat(got.top_ids) == out.top_ids.reshape(-1).tolist()
    assert [len(row) for row in got.top_logprobs] == [k] * n
    assert flat(got.top_logprobs) == sent(out.top_logprobs)
    assert flat(got.top_token_bytes) == out.top_bytes
    assert [len(row) for row in got.requested_logprobs] == [m] * n
    assert flat(got.requested_logprobs) == sent(out.token_id_logprobs)
    assert got.requested_token_bytes == out.token_id_bytes
    assert (got.finish_reason, got.prompt_tokens, got.completion_tokens) == (
        out.finish_reason,
        out.prompt_tokens,
        out.completion_tokens,
    )
    if out.prompt is None:
        assert got.prompt is None
    else:
        assert got.prompt is not None
        assert (got.prompt.ids, got.prompt.token_bytes) == (out.prompt.ids, out.prompt.token_bytes)
        assert got.prompt.logprobs == sent(out.prompt.logprobs)
        assert flat(got.prompt.top_logprobs) == sent(out.prompt.top_logprobs)
        assert flat(got.prompt.requested_logprobs) == sent(out.prompt.token_id_logprobs)
        assert got.prompt.requested_token_bytes == out.prompt.token_id_bytes
        prompt_ids = params.prompt_logprob_token_ids
        positions = LogprobsCollector((), prompt_ids).prompt_positions(got.prompt)
        assert [p.sampled.token_id for p in positions] == out.prompt.ids[1:]
        if prompt_ids:  # the prompt token first, then the ids with their bytes
            id_bytes = dict(zip(prompt_ids, out.prompt.token_id_bytes, strict=True))
            for position in positions:
                others = [(t.token_id, t.token_bytes) for t in position.alternatives[1:]]
                assert others == [
                    (i, id_bytes[i]) for i in prompt_ids if i != position.sampled.token_id
                ]

    if params.logprobs is None and not m:
        return
    collector = LogprobsCollector(params.logprob_token_ids)
    for i, position in enumerate(collector.positions(got)):
        assert position.sampled.token_id == out.token_ids[i]
        entries = [(t.token_id, t.token_bytes, t.logprob) for t in position.alternatives]
        if m:  # explicit ids: the sampled token first, then each other id in request order
            column = dict(zip(params.logprob_token_ids, got.requested_logprobs[i], strict=True))
            id_bytes = dict(zip(params.logprob_token_ids, out.token_id_bytes, strict=True))
            expected = [(out.token_ids[i], out.token_bytes[i], got.logprobs[i])]
            expected += [
                (token, id_bytes[token], column[token])
                for token in params.logprob_token_ids
                if token != out.token_ids[i]
            ]
            assert entries == expected
            assert all(-9999.0 <= value <= 0 for _, _, value in entries)
        else:
            assert entries == list(
                zip(got.top_ids[i], got.top_token_bytes[i], got.top_logprobs[i], strict=True)
            )


@st.composite
def token_steps(draw: st.DrawFn) -> tuple[list[StepOutput], GenerationParams]:
    """The one-token outputs of a request, as the engine makes them step by step."""
    explicit = list(draw(distinct_ids))
    m, k, n = len(explicit), draw(st.integers(0, 3)), draw(st.integers(1, 5))
    raw = st.binary(min_size=1, max_size=4)

    def floats(size: int) -> np.ndarray:
        return np.array(draw(st.lists(logprob, min_size=size, max_size=size)), np.float32)

    steps = [
        StepOutput(
            token_ids=[draw(token_ids)],
            text=draw(st.text(max_size=3)),
            token_bytes=[draw(raw)],
            logprobs=floats(1),
            top_ids=np.array(draw(st.lists(token_ids, min_size=k, max_size=k))).reshape(1, k),
            top_logprobs=floats(k).reshape(1, k),
            top_bytes=draw(st.lists(raw, min_size=k, max_size=k)),
            token_id_logprobs=floats(m).reshape(1, m),
            token_id_bytes=draw(st.lists(raw, min_size=m, max_size=m)) if i == 0 else [],
            finish_reason="length" if i == n - 1 else None,
            prompt_tokens=3,
            completion_tokens=i + 1,
        )
        for i in range(n)
    ]
    return steps, GenerationParams(prompt_ids=[1], logprobs=k, logprob_token_ids=explicit)


@PROPERTIES
@given(token_steps())
def test_a_merged_response_reads_as_its_tokens_one_by_one(drawn) -> None:
    """What the response writer sends when it fell behind: one [n] response for n steps."""
    steps, params = drawn
    singles = [
        TritonOutput.from_arrays(io.output_arrays(step, params), final=step is steps[-1])
        for step in steps
    ]
    merged = TritonOutput.from_arrays(io.output_arrays(merge_outputs(steps), params), final=True)
    assert merged.output_ids == flat(o.output_ids for o in singles)
    assert merged.text == "".join(o.text for o in singles)
    for name in ("token_bytes", "logprobs"):
        assert getattr(merged, name) == flat(getattr(o, name) for o in singles), name
    for name in ("top_ids", "top_logprobs", "top_token_bytes", "requested_logprobs"):
        assert getattr(merged, name) == flat(getattr(o, name) for o in singles), name
    assert merged.requested_token_bytes == singles[0].requested_token_bytes
    assert (merged.finish_reason, merged.completion_tokens) == ("length", len(steps))
    one_by_one = LogprobsCollector(params.logprob_token_ids)
    together = LogprobsCollector(params.logprob_token_ids)
    assert flat(one_by_one.positions(o) for o in singles) == together.positions(merged)
    request = CompletionRequest(prompt=[1], logprobs=params.logprobs, stream=True)
    [choice] = request.to_generation_params(None)
    choice = replace(choice, logprob_token_ids=tuple(params.logprob_token_ids))
    assert CompletionChoiceBuilder(request, choice).build(singles) == CompletionChoiceBuilder(
        request, choice
    ).build([merged])


@st.composite
def completion_streams(draw: st.DrawFn) -> tuple[list[TritonOutput], int | None]:
    """A stream of responses whose tokens split UTF-8 text at random byte boundaries."""
    text = draw(st.text(min_size=1, max_size=12))
    raw = text.encode()
    cuts = sorted(draw(st.sets(st.integers(1, len(raw) - 1), max_size=6))) if len(raw) > 1 else []
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    k = draw(optional(st.integers(0, 2)))
    outputs = []
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        top = [[(j, b"t", -1.0 - j) for j in range(k or 0)]]
        outputs.append(
            TritonOutput(
                output_ids=[i],
                text=piece.decode("utf-8", errors="ignore"),
                token_bytes=[piece],
                logprobs=[-0.5] if k is not None else [],
                top_ids=[[e[0] for e in row] for row in top],
                top_logprobs=[[e[2] for e in row] for row in top],
                top_token_bytes=[[e[1] for e in row] for row in top],
                requested_logprobs=[[]],
                requested_token_bytes=[],
                finish_reason="length" if final else None,
                prompt_tokens=1,
                completion_tokens=i + 1,
                final=final,
            )
        )
    return outputs, k


@PROPERTIES
@given(completion_streams())
def test_joined_stream_chunks_equal_the_full_response(drawn) -> None:
    outputs, k = drawn
    request = CompletionRequest(prompt="p", logprobs=k, stream=True)
    [params] = request.to_generation_params(None)
    full_text, full = CompletionChoiceBuilder(request, params).build(outputs)
    streamed = CompletionChoiceBuilder(request, replace(params))
    chunks = [streamed.build([output]) for output in outputs]
    assert "".join(text for text, _ in chunks) == full_text
    if k is None:
        assert full is None and all(lp is None for _, lp in chunks)
        return
    assert full is not None
    joined = {
        name: flat(getattr(lp, name) for _, lp in chunks if lp is not None)
        for name in ("tokens", "token_logprobs", "text_offset", "top_logprobs")
    }
    assert joined == full.model_dump()
    assert full.text_offset == sorted(full.text_offset) and full.text_offset[0] == 0
