"""parse_request (validation, defaults) and output_arrays (the response tensors' contract)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from backend import contract
from backend import triton_io as io
from backend.outputs import PromptLogprobs, StepOutput, merge_outputs
from backend.params import EngineLimits, GenerationParams, InvalidInputError
from tests.backend.triton_config import config_tensors

LIMITS = EngineLimits(vocab_size=1024, max_model_len=64, max_logprobs=20, max_logprob_token_ids=8)
PROMPT = np.array([5, 6, 7], dtype=np.int32)
DTYPES = {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_STRING": np.object_}


def i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def strings(*values: bytes) -> np.ndarray:
    return np.array(values, dtype=object)


def parse(**arrays: np.ndarray) -> GenerationParams:
    return io.parse_request({contract.INPUT_IDS: PROMPT, **arrays}, LIMITS, request_id="req-1")


def test_absent_inputs_give_the_openai_defaults() -> None:
    params = parse()
    assert params == GenerationParams(prompt_ids=[5, 6, 7], request_id="req-1")
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 1.0, 1.0, 0)
    assert params.seed is None
    assert params.logprobs is None
    assert not params.wants_logprobs
    assert not params.wants_prompt_logprobs
    assert not params.has_penalties
    assert (params.logit_bias, params.allowed_token_ids, params.min_tokens) == ({}, [], 0)


def test_every_input_is_read() -> None:
    params = parse(
        MAX_TOKENS=i32(5),
        TEMPERATURE=f32(0.5),
        TOP_P=f32(0.25),
        TOP_K=i32(7),
        MIN_P=f32(0.125),
        SEED=np.array([2**40], dtype=np.int64),
        STOP=strings(b"END", b"", "世界".encode()),
        STOP_TOKEN_IDS=i32(9, 10),
        IGNORE_EOS=np.array([True]),
        LOGPROBS=i32(3),
        LOGPROB_TOKEN_IDS=i32(1023, 0, 1023),
        PROMPT_LOGPROBS=i32(2),
        PROMPT_LOGPROB_TOKEN_IDS=i32(4, 4),
        PRESENCE_PENALTY=f32(-2.0),
        FREQUENCY_PENALTY=f32(1.5),
        REPETITION_PENALTY=f32(1.25),
        LOGIT_BIAS_IDS=i32(3, 8),
        LOGIT_BIAS_VALUES=f32(-100.0, 2.5),
        ALLOWED_TOKEN_IDS=i32(3, 8, 9),
        MIN_TOKENS=i32(5),
        INCLUDE_STOP_STR_IN_OUTPUT=np.array([True]),
    )
    assert params == GenerationParams(
        prompt_ids=[5, 6, 7],
        max_tokens=5,
        temperature=0.5,
        top_p=0.25,
        top_k=7,
        min_p=0.125,
        seed=2**40,
        stop=["END", "世界"],  # empty stop strings dropped
        stop_token_ids=[9, 10],
        ignore_eos=True,
        logprobs=3,
        logprob_token_ids=[1023, 0, 1023],  # order and duplicates kept
        prompt_logprobs=2,
        prompt_logprob_token_ids=[4, 4],
        presence_penalty=-2.0,
        frequency_penalty=1.5,
        repetition_penalty=1.25,
        logit_bias={3: -100.0, 8: 2.5},
        allowed_token_ids=[3, 8, 9],
        min_tokens=5,  # == MAX_TOKENS is allowed
        include_stop_str_in_output=True,
        request_id="req-1",
    )
    assert all(isinstance(i, int) for i in params.prompt_ids + params.logprob_token_ids)


def test_edge_values_that_are_valid() -> None:
    params = parse(
        MAX_TOKENS=i32(0),
        TEMPERATURE=f32(0.0),
        TOP_P=f32(1.0),
        TOP_K=i32(-1),
        LOGPROBS=i32(0),
        LOGPROB_TOKEN_IDS=i32(*range(8)),
        SEED=np.array([-1], dtype=np.int64),
    )
    assert params.max_tokens == 0
    assert params.top_k == 0  # -1 means off, like 0
    assert params.logprobs == 0  # only the sampled token's logprob
    assert params.wants_logprobs
    assert params.seed == -1
    assert io.parse_request({contract.INPUT_IDS: i32(*[1] * 63)}, LIMITS).prompt_ids == [1] * 63
    # Other integer widths are accepted for id and count inputs.
    wide = io.parse_request(
        {
            contract.INPUT_IDS: np.array([1, 2], np.int64),
            contract.MAX_TOKENS: np.array([3], np.uint32),
        },
        LIMITS,
    )
    assert (wide.prompt_ids, wide.max_tokens) == ([1, 2], 3)


@pytest.mark.parametrize(
    ("arrays", "parameter", "message"),
    [
        ({contract.INPUT_IDS: None}, contract.INPUT_IDS, "is required"),
        ({contract.INPUT_IDS: i32()}, contract.INPUT_IDS, "the prompt is empty"),
        (
            {contract.INPUT_IDS: f32(1.0, 2.0)},
            contract.INPUT_IDS,
            "expected integer token ids, got dtype",
        ),
        (
            {contract.INPUT_IDS: np.ones((1, 3), np.int32)},
            contract.INPUT_IDS,
            "expected a 1-D tensor",
        ),
        (
            {contract.INPUT_IDS: i32(1, 1024)},
            contract.INPUT_IDS,
            "id 1024 is outside the vocabulary",
        ),
        (
            {contract.INPUT_IDS: i32(-1)},
            contract.INPUT_IDS,
            "id -1 is outside the vocabulary [0, 1024)",
        ),
        (
            {contract.INPUT_IDS: i32(*[1] * 64)},
            contract.INPUT_IDS,
            "has 64 tokens, this model's maximum context length is 64 tokens",
        ),
        ({contract.MAX_TOKENS: i32(-1)}, contract.MAX_TOKENS, "must be >= 0, got -1"),
        ({contract.MAX_TOKENS: f32(2.0)}, contract.MAX_TOKENS, "unexpected dtype float32"),
        (
            {contract.MAX_TOKENS: i32(1, 2)},
            contract.MAX_TOKENS,
            "expected one element, got shape [2]",
        ),
        ({contract.MAX_TOKENS: i32()}, contract.MAX_TOKENS, "expected one element, got shape [0]"),
        ({contract.TEMPERATURE: f32(-0.5)}, contract.TEMPERATURE, "must be >= 0, got -0.5"),
        ({contract.TEMPERATURE: f32(math.inf)}, contract.TEMPERATURE, "must be >= 0, got inf"),
        ({contract.TEMPERATURE: f32(math.nan)}, contract.TEMPERATURE, "must be >= 0, got nan"),
        ({contract.TEMPERATURE: i32(1)}, contract.TEMPERATURE, "unexpected dtype int32"),
        ({contract.TOP_P: f32(0.0)}, contract.TOP_P, "must be in (0, 1], got 0.0"),
        ({contract.TOP_P: f32(1.5)}, contract.TOP_P, "must be in (0, 1], got 1.5"),
        ({contract.TOP_P: f32(math.nan)}, contract.TOP_P, "must be in (0, 1], got nan"),
        ({contract.TOP_K: i32(-2)}, contract.TOP_K, "must be >= 0 (or -1 for off), got -2"),
        ({contract.MIN_P: f32(-0.5)}, contract.MIN_P, "must be in [0, 1], got -0.5"),
        ({contract.MIN_P: f32(1.5)}, contract.MIN_P, "must be in [0, 1], got 1.5"),
        ({contract.MIN_P: f32(math.nan)}, contract.MIN_P, "must be in [0, 1], got nan"),
        ({contract.TOP_K: f32(3.0)}, contract.TOP_K, "unexpected dtype float32"),
        ({contract.SEED: f32(1.0)}, contract.SEED, "unexpected dtype float32"),
        ({contract.STOP: strings(b"ok", b"\xff")}, contract.STOP, "is not valid UTF-8"),
        ({contract.STOP_TOKEN_IDS: i32(3, 1024)}, contract.STOP_TOKEN_IDS, "id 1024 is outside"),
        (
            {contract.STOP_TOKEN_IDS: f32(3.0)},
            contract.STOP_TOKEN_IDS,
            "expected integer token ids",
        ),
        ({contract.IGNORE_EOS: i32(1)}, contract.IGNORE_EOS, "unexpected dtype int32"),
        ({contract.LOGPROBS: i32(-1)}, contract.LOGPROBS, "must be in [0, 20], got -1"),
        ({contract.LOGPROBS: i32(21)}, contract.LOGPROBS, "must be in [0, 20], got 21"),
        ({contract.LOGPROBS: f32(2.0)}, contract.LOGPROBS, "unexpected dtype float32"),
        ({contract.LOGPROB_TOKEN_IDS: i32()}, contract.LOGPROB_TOKEN_IDS, "must not be empty"),
        (
            {contract.LOGPROB_TOKEN_IDS: i32(*range(9))},
            contract.LOGPROB_TOKEN_IDS,
            "9 ids requested, at most 8",
        ),
        (
            {contract.LOGPROB_TOKEN_IDS: i32(0, 1024)},
            contract.LOGPROB_TOKEN_IDS,
            "id 1024 is outside",
        ),
        ({contract.LOGPROB_TOKEN_IDS: i32(-1)}, contract.LOGPROB_TOKEN_IDS, "id -1 is outside"),
        (
            {contract.LOGPROB_TOKEN_IDS: f32(1.0)},
            contract.LOGPROB_TOKEN_IDS,
            "expected integer token ids",
        ),
        (
            {contract.PROMPT_LOGPROBS: i32(21)},
            contract.PROMPT_LOGPROBS,
            "must be in [0, 20], got 21",
        ),
        (
            {contract.PROMPT_LOGPROBS: i32(-1)},
            contract.PROMPT_LOGPROBS,
            "must be in [0, 20], got -1",
        ),
        (
            {contract.PROMPT_LOGPROB_TOKEN_IDS: i32()},
            contract.PROMPT_LOGPROB_TOKEN_IDS,
            "must not be empty",
        ),
        (
            {contract.PROMPT_LOGPROB_TOKEN_IDS: i32(*range(9))},
            contract.PROMPT_LOGPROB_TOKEN_IDS,
            "9 ids requested, at most 8",
        ),
        (
            {contract.PROMPT_LOGPROB_TOKEN_IDS: i32(1024)},
            contract.PROMPT_LOGPROB_TOKEN_IDS,
            "id 1024 is",
        ),
        (
            {contract.PRESENCE_PENALTY: f32(2.5)},
            contract.PRESENCE_PENALTY,
            "must be in [-2, 2], got 2.5",
        ),
        (
            {contract.PRESENCE_PENALTY: f32(math.nan)},
            contract.PRESENCE_PENALTY,
            "must be in [-2, 2]",
        ),
        (
            {contract.FREQUENCY_PENALTY: f32(-3.0)},
            contract.FREQUENCY_PENALTY,
            "must be in [-2, 2], got -3",
        ),
        (
            {contract.FREQUENCY_PENALTY: i32(1)},
            contract.FREQUENCY_PENALTY,
            "unexpected dtype int32",
        ),
        (
            {contract.REPETITION_PENALTY: f32(0.0)},
            contract.REPETITION_PENALTY,
            "must be > 0, got 0",
        ),
        (
            {contract.REPETITION_PENALTY: f32(math.inf)},
            contract.REPETITION_PENALTY,
            "must be > 0, got inf",
        ),
        (
            {contract.LOGIT_BIAS_IDS: i32(3, 4), contract.LOGIT_BIAS_VALUES: f32(1.0)},
            contract.LOGIT_BIAS_VALUES,
            "has 1 values for 2 ids",
        ),
        (
            {contract.LOGIT_BIAS_VALUES: f32(1.0)},
            contract.LOGIT_BIAS_VALUES,
            "has 1 values for 0 ids",
        ),
        (
            {contract.LOGIT_BIAS_IDS: i32(1024), contract.LOGIT_BIAS_VALUES: f32(1.0)},
            contract.LOGIT_BIAS_IDS,
            "id 1024 is outside the vocabulary",
        ),
        (
            {contract.LOGIT_BIAS_IDS: i32(3), contract.LOGIT_BIAS_VALUES: f32(100.5)},
            contract.LOGIT_BIAS_VALUES,
            "each bias must be in [-100, 100]",
        ),
        (
            {contract.LOGIT_BIAS_IDS: i32(3), contract.LOGIT_BIAS_VALUES: f32(math.nan)},
            contract.LOGIT_BIAS_VALUES,
            "each bias must be in [-100, 100]",
        ),
        ({contract.ALLOWED_TOKEN_IDS: i32()}, contract.ALLOWED_TOKEN_IDS, "must not be empty"),
        (
            {contract.ALLOWED_TOKEN_IDS: i32(5, 1024)},
            contract.ALLOWED_TOKEN_IDS,
            "id 1024 is outside",
        ),
        (
            {contract.MIN_TOKENS: i32(17)},
            contract.MIN_TOKENS,
            "must be in [0, MAX_TOKENS=16], got 17",
        ),
        (
            {contract.MIN_TOKENS: i32(3), contract.MAX_TOKENS: i32(2)},
            contract.MIN_TOKENS,
            "must be in [0, MAX_TOKENS=2], got 3",
        ),
        ({contract.MIN_TOKENS: i32(-1)}, contract.MIN_TOKENS, "got -1"),
        (
            {contract.INPUT_IDS: i32(*[1] * 60), contract.MIN_TOKENS: i32(5)},
            contract.MIN_TOKENS,
            "must be at most the 4 tokens that this model's maximum context length of 64 tokens "
            "leaves after the prompt's 60, got 5",
        ),
        (
            {contract.INCLUDE_STOP_STR_IN_OUTPUT: i32(1)},
            contract.INCLUDE_STOP_STR_IN_OUTPUT,
            "unexpected dtype",
        ),
        (
            {contract.STOP: strings(*(b"s%d" % i for i in range(65)))},
            contract.STOP,
            "holds 65 strings, at most 64",
        ),
        (
            {contract.STOP: strings(b"\n", b"x" * 1025)},
            contract.STOP,
            "a string has 1025 characters, at most 1024",
        ),
        (
            {contract.LOGPROB_TOKEN_IDS: np.ones((2, 2), np.int32)},
            contract.LOGPROB_TOKEN_IDS,
            "expected a 1-D tensor, got shape [2, 2]",
        ),
    ],
)
def test_invalid_input_names_its_parameter(
    arrays: dict[str, np.ndarray | None], parameter: str, message: str
) -> None:
    given = {contract.INPUT_IDS: PROMPT, **arrays}
    with pytest.raises(InvalidInputError) as info:
        io.parse_request({k: v for k, v in given.items() if v is not None}, LIMITS)
    assert info.value.parameter == parameter
    assert str(info.value).startswith(f"{parameter}: ")
    assert message in str(info.value)


def step_output(n: int, k: int, m: int, first: bool = True) -> StepOutput:
    rng = np.random.default_rng(n * 100 + k * 10 + m)
    return StepOutput(
        token_ids=list(range(10, 10 + n)),
        text="é😀"[:n],
        token_bytes=[b"\xc3", b"\xa9"][:n],
        logprobs=-rng.random(n).astype(np.float32),
        top_ids=np.arange(n * k, dtype=np.int64).reshape(n, k),
        top_logprobs=-rng.random((n, k)).astype(np.float32),
        top_bytes=[b"t%d" % i for i in range(n * k)],
        token_id_logprobs=-rng.random((n, m)).astype(np.float32),
        token_id_bytes=[b"m%d" % i for i in range(m)] if first else [],
        finish_reason=None,
        prompt_tokens=3,
        completion_tokens=n,
    )


@pytest.mark.parametrize(
    ("n", "logprobs", "m", "first"),
    [
        (1, None, 0, True),  # no logprobs at all
        (1, 0, 0, True),  # sampled logprob only
        (1, 3, 0, True),  # top-k
        (1, None, 2, True),  # explicit ids only
        (1, 2, 4, True),  # both
        (1, 2, 4, False),  # a later response: no id bytes
        (2, 3, 2, True),  # several tokens in one response
        (0, 5, 3, True),  # an empty final (max_tokens 0)
    ],
)
def test_output_shapes_and_dtypes_follow_the_config(
    n: int, logprobs: int | None, m: int, first: bool
) -> None:
    k = logprobs or 0
    params = GenerationParams(prompt_ids=[1, 2, 3], logprobs=logprobs, logprob_token_ids=[4] * m)
    out = step_output(n, k, m, first)
    arrays = io.output_arrays(out, params)

    declared = config_tensors("llm", "output")
    assert set(arrays) == set(declared)
    for name, array in arrays.items():
        assert array.dtype == DTYPES[declared[name]], name
    expected_shapes = {
        contract.OUTPUT_IDS: (n,),
        contract.TEXT_OUTPUT: (1,),
        contract.OUTPUT_TOKEN_BYTES: (n,),
        contract.OUTPUT_LOGPROBS: (n if logprobs is not None else 0,),
        contract.TOP_LOGPROB_IDS: (n, k),
        contract.TOP_LOGPROBS: (n, k),
        contract.TOP_LOGPROB_TOKEN_BYTES: (n, k),
        contract.LOGPROB_TOKEN_LOGPROBS: (n, m),
        contract.LOGPROB_TOKEN_BYTES: (m if first else 0,),
        contract.FINISH_REASON: (1,),
        contract.PROMPT_TOKENS: (1,),
        contract.COMPLETION_TOKENS: (1,),
    }
    assert {name: arrays[name].shape for name in expected_shapes} == expected_shapes
    # Values travel unchanged.
    assert arrays[contract.OUTPUT_IDS].tolist() == out.token_ids
    assert arrays[contract.TEXT_OUTPUT].tolist() == [out.text.encode()]
    assert arrays[contract.OUTPUT_TOKEN_BYTES].tolist() == out.token_bytes
    if logprobs is not None:
        np.testing.assert_array_equal(arrays[contract.OUTPUT_LOGPROBS], out.logprobs)
    np.testing.assert_array_equal(arrays[contract.TOP_LOGPROB_IDS], out.top_ids)
    np.testing.assert_array_equal(arrays[contract.TOP_LOGPROBS], out.top_logprobs)
    assert arrays[contract.TOP_LOGPROB_TOKEN_BYTES].reshape(-1).tolist() == out.top_bytes
    np.testing.assert_array_equal(arrays[contract.LOGPROB_TOKEN_LOGPROBS], out.token_id_logprobs)
    assert arrays[contract.LOGPROB_TOKEN_BYTES].tolist() == out.token_id_bytes
    assert arrays[contract.PROMPT_TOKENS].tolist() == [3]
    assert arrays[contract.COMPLETION_TOKENS].tolist() == [n]


def test_top_bytes_are_laid_out_row_major() -> None:
    params = GenerationParams(prompt_ids=[1], logprobs=3)
    arrays = io.output_arrays(step_output(2, 3, 0), params)
    assert arrays[contract.TOP_LOGPROB_TOKEN_BYTES].tolist() == [
        [b"t0", b"t1", b"t2"],
        [b"t3", b"t4", b"t5"],
    ]


def test_minus_infinity_is_sent_as_minus_9999() -> None:
    params = GenerationParams(prompt_ids=[1], logprobs=2, logprob_token_ids=[1, 2])
    out = step_output(1, 2, 2)
    out.logprobs = np.array([-np.inf], np.float32)
    out.top_logprobs = np.array([[-0.5, -np.inf]], np.float32)
    out.token_id_logprobs = np.array([[-np.inf, -1.25]], np.float32)
    arrays = io.output_arrays(out, params)
    assert arrays[contract.OUTPUT_LOGPROBS].tolist() == [-9999.0]
    assert arrays[contract.TOP_LOGPROBS].tolist() == [[-0.5, -9999.0]]
    assert arrays[contract.LOGPROB_TOKEN_LOGPROBS].tolist() == [[-9999.0, -1.25]]
    assert contract.NEG_INF_LOGPROB == -9999.0


@pytest.mark.parametrize(
    ("reason", "sent"), [(None, b""), ("stop", b"stop"), ("length", b"length")]
)
def test_finish_reason_is_empty_until_the_final_response(reason: str | None, sent: bytes) -> None:
    out = step_output(1, 0, 0)
    out.finish_reason = reason
    arrays = io.output_arrays(out, GenerationParams(prompt_ids=[1]))
    assert arrays[contract.FINISH_REASON].tolist() == [sent]


@pytest.mark.parametrize("stop_reason", ["\n\nQ: é", 42, None])
def test_stop_reason_is_empty_until_the_final_response_then_json(
    stop_reason: str | int | None,
) -> None:
    """STOP_REASON, also after the writer merged the final step with earlier ones."""
    params = GenerationParams(prompt_ids=[1])
    first, last = step_output(1, 0, 0), step_output(1, 0, 0, first=False)
    last.finish_reason, last.stop_reason = "stop", stop_reason
    assert io.output_arrays(first, params)[contract.STOP_REASON].tolist() == [b""]
    for out in (last, merge_outputs([first, last])):
        [sent] = io.output_arrays(out, params)[contract.STOP_REASON].tolist()
        assert json.loads(sent) == stop_reason


def prompt_shapes(p: int, k: int, m: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the prompt outputs for a P-token prompt (P - 1 scored positions; 0 = none)."""
    n = max(p - 1, 0)
    return {
        contract.PROMPT_IDS: (p,),
        contract.PROMPT_TOKEN_BYTES: (p,),
        contract.PROMPT_TOKEN_LOGPROBS: (n,),
        contract.PROMPT_TOP_LOGPROB_IDS: (n, k),
        contract.PROMPT_TOP_LOGPROBS: (n, k),
        contract.PROMPT_TOP_LOGPROB_TOKEN_BYTES: (n, k),
        contract.PROMPT_LOGPROB_TOKEN_LOGPROBS: (n, m),
        contract.PROMPT_LOGPROB_TOKEN_BYTES: (m if p else 0,),
    }


@pytest.mark.parametrize(("k", "m"), [(0, 0), (2, 0), (0, 3), (2, 3)])
def test_prompt_outputs_are_zero_size_except_on_the_response_carrying_them(k: int, m: int) -> None:
    params = GenerationParams(
        prompt_ids=[5, 6, 7, 8], prompt_logprobs=k or None, prompt_logprob_token_ids=[9] * m
    )
    declared = config_tensors("llm", "output")
    without = io.output_arrays(step_output(1, 0, 0), params)
    assert {name: without[name].shape for name in prompt_shapes(0, k, m)} == prompt_shapes(0, k, m)

    rng = np.random.default_rng(k + m)
    out = step_output(1, 0, 0)
    out.prompt = PromptLogprobs(
        ids=[5, 6, 7, 8],
        token_bytes=[b"a", b"b", b"c", b"d"],
        logprobs=np.array([-1.0, -np.inf, -2.0], np.float32),
        top_ids=np.arange(3 * k).reshape(3, k),
        top_logprobs=-rng.random((3, k)).astype(np.float32),
        top_bytes=[b"t%d" % i for i in range(3 * k)],
        token_id_logprobs=-rng.random((3, m)).astype(np.float32),
        token_id_bytes=[b"nine"] * m,
    )
    arrays = io.output_arrays(out, params)
    assert {name: arrays[name].shape for name in prompt_shapes(4, k, m)} == prompt_shapes(4, k, m)
    for name in prompt_shapes(4, k, m):
        assert arrays[name].dtype == DTYPES[declared[name]], name
        assert without[name].dtype == DTYPES[declared[name]], name
    assert arrays[contract.PROMPT_IDS].tolist() == [5, 6, 7, 8]
    assert arrays[contract.PROMPT_TOKEN_BYTES].tolist() == [b"a", b"b", b"c", b"d"]
    assert arrays[contract.PROMPT_TOKEN_LOGPROBS].tolist() == [-1.0, -9999.0, -2.0]
    np.testing.assert_array_equal(arrays[contract.PROMPT_TOP_LOGPROB_IDS], out.prompt.top_ids)
    np.testing.assert_array_equal(arrays[contract.PROMPT_TOP_LOGPROBS], out.prompt.top_logprobs)
    np.testing.assert_array_equal(
        arrays[contract.PROMPT_LOGPROB_TOKEN_LOGPROBS], out.prompt.token_id_logprobs
    )
    assert (
        arrays[contract.PROMPT_TOP_LOGPROB_TOKEN_BYTES].reshape(-1).tolist() == out.prompt.top_bytes
    )
    assert arrays[contract.PROMPT_LOGPROB_TOKEN_BYTES].tolist() == [b"nine"] * m


@pytest.mark.parametrize(
    "names",
    [
        {contract.OUTPUT_IDS, contract.TEXT_OUTPUT, contract.FINISH_REASON},
        {contract.TOP_LOGPROBS, contract.PROMPT_IDS},
        set(),
    ],
)
def test_only_the_requested_outputs_are_built(names: set[str]) -> None:
    out = step_output(2, 3, 2)
    params = GenerationParams(prompt_ids=[1], logprobs=3, logprob_token_ids=[5, 6])
    every = io.output_arrays(out, params)
    built = io.output_arrays(out, params, names)
    assert set(built) == names
    for name in names:
        assert np.array_equal(built[name], every[name]), name
    assert set(every) == set(config_tensors("llm", "output"))
