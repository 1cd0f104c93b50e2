"""STRUCTURED_OUTPUT against the real tritonserver, as a tritonclient caller sends it: each kind
takes its shape (JSON validated with jsonschema, at temperature 0 and 1), 16 concurrent streams
mixing constrained and free rows each equal their solo run, a cancelled constrained stream frees
its slot, the ensemble takes the input too, and bad specs are INVALID_ARG while the server goes
on serving."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import jsonschema
import numpy as np
import pytest

from backend import contract
from backend.structured_output import StructuredOutput
from tests.integration.openai_support import ATOL, held, metric, wait_for
from tests.reference import tokenizer
from tests.streaming import Streamer, StreamResult, generate

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["label", "confidence"],
    "additionalProperties": False,
}
LABELS = ("spam", "ham", "unsure")
PROMPT = "Triton serves the model"


def _inputs(
    prompt_ids: list[int], spec: StructuredOutput | None, **extra: np.ndarray
) -> dict[str, np.ndarray]:
    arrays = {
        contract.INPUT_IDS: np.array(prompt_ids, dtype=np.int32),
        contract.MAX_TOKENS: np.array([48], dtype=np.int32),
        contract.TEMPERATURE: np.array([0.0], dtype=np.float32),
        **extra,
    }
    if spec is not None:
        arrays[contract.STRUCTURED_OUTPUT] = np.array([spec.to_json().encode()], dtype=object)
    return arrays


def _sampled(
    url: str, prompt_ids: list[int], spec: StructuredOutput, temperature: float, seed: int
) -> StreamResult:
    temperatures = np.array([temperature], dtype=np.float32)
    seeds = np.array([seed], dtype=np.int64)
    return generate(url, "llm", _inputs(prompt_ids, spec, TEMPERATURE=temperatures, SEED=seeds))


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[int]:
    return tokenizer(model_dir)(PROMPT)["input_ids"]


def test_choice_is_always_one_of_the_choices(triton_server, prompt_ids) -> None:
    spec = StructuredOutput("choice", LABELS)
    for seed in range(6):
        result = _sampled(triton_server.grpc_url, prompt_ids, spec, 1.0, seed)
        assert result.error is None, result.error
        assert result.text in LABELS and result.finish_reason == "stop"


def test_regex_output_fully_matches(triton_server, prompt_ids) -> None:
    pattern = r"[A-Z]{2}-[0-9]{4}"
    result = generate(
        triton_server.grpc_url, "llm", _inputs(prompt_ids, StructuredOutput("regex", pattern))
    )
    assert result.error is None and re.fullmatch(pattern, result.text), result.text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(triton_server, prompt_ids, temperature: float) -> None:
    spec = StructuredOutput.json_schema(SCHEMA, disable_any_whitespace=True)
    for seed in range(4 if temperature else 1):
        result = _sampled(triton_server.grpc_url, prompt_ids, spec, temperature, seed)
        assert result.error is None and result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), SCHEMA)


def test_the_ensemble_takes_it_with_a_text_prompt(triton_server) -> None:
    arrays = {
        contract.TEXT_INPUT: np.array([PROMPT.encode()], dtype=object),
        contract.MAX_TOKENS: np.array([16], dtype=np.int32),
        contract.STRUCTURED_OUTPUT: np.array(
            [StructuredOutput("choice", LABELS).to_json().encode()], dtype=object
        ),
    }
    result = generate(triton_server.grpc_url, "ensemble", arrays)
    assert result.error is None and result.text in LABELS


def test_sixteen_concurrent_streams_mixing_constrained_and_free_equal_each_alone(
    triton_server, model_dir
) -> None:
    ids = tokenizer(model_dir)("Triton serves the model and streams every token.")["input_ids"]
    specs = [
        StructuredOutput("choice", LABELS),
        StructuredOutput("regex", r"[a-z]{3,6}"),
        StructuredOutput.json_schema(SCHEMA, disable_any_whitespace=True),
    ]
    cases = [
        _inputs(ids[: 3 + i], specs[i % 3] if i % 2 else None, LOGPROBS=np.array([1], np.int32))
        for i in range(16)
    ]
    alone = [generate(triton_server.grpc_url, "llm", case) for case in cases]
    streamers = [Streamer(triton_server.grpc_url) for _ in cases]
    try:
        for streamer, case in zip(streamers, cases, strict=True):
            streamer.send("llm", case)
        together = [streamer.collect() for streamer in streamers]
    finally:
        for streamer in streamers:
            streamer.close()
    for one, many in zip(alone, together, strict=True):
        assert many.error is None and many.token_ids == one.token_ids and many.text == one.text
        # The suite's tolerance: fp32 row sums differ by ~1.1e-5 in some processes
        # (tests/kernels/test_logprobs.py, TORCH_PATH_ATOL).
        np.testing.assert_allclose(
            many.cat(contract.OUTPUT_LOGPROBS), one.cat(contract.OUTPUT_LOGPROBS), atol=ATOL
        )
    assert all(many.text in LABELS for many in together[3::6])  # the choice rows


def test_a_cancelled_constrained_stream_frees_its_slot(triton_server, prompt_ids) -> None:
    active = "llm_active_sequences"
    cancelled_before = metric(triton_server.metrics_url, "llm_cancelled_requests_total")
    streamer = Streamer(triton_server.grpc_url)
    endless = StructuredOutput("regex", "b{400}")  # no end within MAX_TOKENS
    with held(triton_server):  # it cannot finish before the cancel
        streamer.send(
            "llm",
            _inputs(
                prompt_ids,
                endless,
                MAX_TOKENS=np.array([300], np.int32),
                IGNORE_EOS=np.array([True]),
            ),
        )
        first, error, _ = streamer.next()
        assert error is None and first is not None
        assert first[contract.TEXT_OUTPUT][0].decode() == "b"
        streamer.close(cancel=True)
    assert wait_for(
        lambda: (
            metric(triton_server.metrics_url, "llm_cancelled_requests_total")
            == cancelled_before + 1
        )
    )
    assert wait_for(lambda: metric(triton_server.metrics_url, active) == 0)
    after = generate(triton_server.grpc_url, "llm", _inputs(prompt_ids, None))
    assert after.error is None and len(after.token_ids) > 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ('{"type": "choice", "value": []}', "`choice` must be a non-empty list"),
        ('{"type": "regex", "value": "a", "json": 1}', "unknown keys"),
        ("no json", "not JSON"),
        ('{"type": "regex", "value": "[0-9"}', "regex does not compile"),
        ('{"type": "json", "value": {"type": "nonsense"}}', "json does not compile"),
        ('{"type": "grammar", "value": "root ::= "}', "grammar does not compile"),
    ],
)
def test_a_bad_spec_is_refused_and_the_next_request_succeeds(
    triton_server, prompt_ids, spec: str, message: str
) -> None:
    streamer = Streamer(triton_server.grpc_url)
    try:
        arrays = _inputs(prompt_ids, None)
        arrays[contract.STRUCTURED_OUTPUT] = np.array([spec.encode()], dtype=object)
        bad = streamer.run("llm", arrays)
        assert bad.error is not None and bad.error.startswith(f"{contract.STRUCTURED_OUTPUT}: "), (
            bad.error
        )
        assert message in bad.error
        good = streamer.run("llm", _inputs(prompt_ids, StructuredOutput("choice", LABELS)))
        assert good.error is None and good.text in LABELS
    finally:
        streamer.close()


def test_a_spec_that_does_not_compile_is_invalid_arg_over_http(triton_server) -> None:
    """Over HTTP the status is visible: INVALID_ARG is 400, also when the compile found it."""
    body = {
        "INPUT_IDS": [1, 2, 3],
        "STRUCTURED_OUTPUT": json.dumps({"type": "regex", "value": "(unclosed"}),
    }
    request = urllib.request.Request(
        f"{triton_server.http_url}/v2/models/llm/generate_stream",
        data=json.dumps(body).encode(),
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
        status = response.status
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    assert status == 400, (status, text)
    assert "STRUCTURED_OUTPUT: regex does not compile" in text


def test_compiles_and_cache_hits_are_counted(triton_server, prompt_ids) -> None:
    """At least: earlier tests' counts may still be on their way (metrics go out every 50 ms);
    the exact counts are checked on the engine (tests/backend/test_structured_outputs.py)."""
    spec = StructuredOutput("choice", ("first", "second", "third"))
    compiles = metric(triton_server.metrics_url, "llm_grammar_compiles_total")
    hits = metric(triton_server.metrics_url, "llm_grammar_cache_hits_total")
    for _ in range(3):
        assert generate(triton_server.grpc_url, "llm", _inputs(prompt_ids, spec)).error is None

    def counted() -> bool:
        url = triton_server.metrics_url
        return (
            metric(url, "llm_grammar_cache_hits_total") >= hits + 2
            and metric(url, "llm_grammar_compiles_total") >= compiles + 1
        )

    assert wait_for(counted)
    assert metric(triton_server.metrics_url, "llm_grammar_compile_seconds_total") > 0
