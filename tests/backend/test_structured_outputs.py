"""Structured outputs in the engine (xgrammar): every kind's output takes its shape at
temperature 0 and 1 and ends with `stop`, constrained and free rows batched equal each alone,
logprobs stay raw, bad specs are INVALID, compiles are cached and time out, slots are freed."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from backend import contract
from backend.default_model import PASSAGE
from backend.engine import Engine
from backend.grammar import COMPILE_THREADS
from backend.model_runner import ModelRunner
from backend.outputs import BUSY, CANCELLED, INVALID
from backend.params import EngineLimits, GenerationParams, InvalidInputError
from backend.structured_output import StructuredOutput
from backend.triton_io import parse_request
from tests.backend.test_batching import run
from tests.reference import reference_logprobs, tokenizer
from tests.sinks import RecordingSink

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "sure": {"type": "boolean"},
    },
    "required": ["label", "score", "sure"],
    "additionalProperties": False,
}
CHOICES = ("yes", "no", "maybe not")
WAIT_S = 60.0
REGEX = r"[0-9]{3}-[a-z]{2}"
SPECS = {
    "choice": StructuredOutput("choice", CHOICES),
    "regex": StructuredOutput("regex", REGEX),
    "json": StructuredOutput.json_schema(SCHEMA, disable_any_whitespace=True),
    "json_object": StructuredOutput("json_object", "", disable_any_whitespace=True),
    "grammar": StructuredOutput("grammar", 'root ::= "x" [0-9] [0-9]? "y"'),
}


def conforms(kind: str, text: str) -> bool:
    if kind == "choice":
        return text in CHOICES
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "grammar":
        return re.fullmatch(r"x[0-9][0-9]?y", text) is not None
    value = json.loads(text)
    if kind == "json":
        jsonschema.validate(value, SCHEMA)
    return isinstance(value, dict)


def _prompt(model_dir: Path) -> list[int]:
    """A prompt whose greedy `json_object` closes at once (the model is built deterministically)."""
    return tokenizer(model_dir)("Triton serves the model")["input_ids"]


def _text(sink: RecordingSink) -> str:
    return "".join(out.text for out in sink.outputs)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_every_kind_takes_its_shape_and_ends_with_stop(engine, model_dir, kind: str) -> None:
    """Sampled too, but for `json_object`: any object has no end a small random model must reach
    (keys and strings go on), while the others' shapes are bounded."""
    prompt = _prompt(model_dir)
    hot = [] if kind == "json_object" else [(1.0, 1), (1.0, 2), (1.0, 3)]
    requests = [
        GenerationParams(
            prompt_ids=prompt,
            max_tokens=64,
            temperature=temperature,
            seed=seed,
            structured_output=SPECS[kind],
        )
        for temperature, seed in [(0.0, None), *hot]
    ]
    for sink in run(engine, requests):
        assert sink.error is None, sink.error
        assert sink.outputs[-1].finish_reason == "stop", _text(sink)
        assert conforms(kind, _text(sink)), _text(sink)


def test_constrained_and_free_rows_together_equal_each_alone(engine, model_dir) -> None:
    passage = tokenizer(model_dir)(PASSAGE)["input_ids"]
    kinds = sorted(SPECS)
    requests = [
        GenerationParams(
            prompt_ids=passage[i : i + 3 + 2 * i],
            max_tokens=24,
            temperature=0.0,
            logprobs=2,
            structured_output=SPECS[kinds[i % len(kinds)]] if i % 2 else None,
        )
        for i in range(16)
    ]
    alone = [run(engine, [params])[0] for params in requests]
    together = run(engine, requests)
    complete = 0
    for one, many, params in zip(alone, together, requests, strict=True):
        assert many.error is None and many.token_ids == one.token_ids
        assert _text(many) == _text(one)
        spec = params.structured_output
        if spec is not None and many.outputs[-1].finish_reason == "stop":  # else cut at 24
            assert conforms(spec.kind, _text(many)), _text(many)
            complete += 1
    assert complete >= 4


def test_logprobs_stay_the_raw_log_softmax(engine, model_dir) -> None:
    """The mask changes what is sampled, not what is reported (as with logit_bias)."""
    prompt = _prompt(model_dir)
    ids = [5, 17, 300]
    params = GenerationParams(
        prompt_ids=prompt,
        max_tokens=16,
        temperature=0.0,
        logprobs=3,
        logprob_token_ids=ids,
        structured_output=SPECS["regex"],
    )
    [sink] = run(engine, [params])
    ref = reference_logprobs(model_dir, prompt, sink.token_ids)
    positions = np.arange(len(sink.token_ids))
    np.testing.assert_allclose(sink.logprobs, ref[positions, sink.token_ids], atol=1e-4)
    np.testing.assert_allclose(sink.id_logprobs, ref[:, ids], atol=1e-4)
    # The grammar forced tokens that are not the model's own first choice somewhere.
    assert any(ref[p].argmax() != token for p, token in enumerate(sink.token_ids))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput("regex", "[0-9"), "regex does not compile"),
        (StructuredOutput("grammar", "root ::= "), "grammar does not compile: "),
        (StructuredOutput("grammar", '?start: "yes" | "no"'), "grammar does not compile (EBNF"),
        (StructuredOutput.json_schema({"type": "nonsense"}), "json does not compile"),
    ],
)
def test_a_spec_that_does_not_compile_is_invalid_and_the_engine_goes_on(
    engine, model_dir, spec: StructuredOutput, message: str
) -> None:
    bad, good = RecordingSink(), RecordingSink()
    prompt = _prompt(model_dir)
    run(
        engine,
        [
            GenerationParams(prompt_ids=prompt, max_tokens=8, structured_output=spec),
            GenerationParams(prompt_ids=prompt, max_tokens=8, temperature=0.0),
        ],
        [bad, good],
    )
    assert bad.kind == INVALID and bad.error is not None
    assert bad.error.startswith(f"{contract.STRUCTURED_OUTPUT}: {message}"), bad.error
    assert good.error is None and len(good.token_ids) == 8


def test_a_grammar_that_only_min_tokens_keeps_open_is_invalid(engine, model_dir) -> None:
    """Once the choice is complete only EOS fits, which MIN_TOKENS bans: an error, not an EOS
    sampled as the argmax of a row of -inf (id 0 is EOS on this model)."""
    choice = StructuredOutput("choice", ("yes",))
    params = GenerationParams(
        prompt_ids=_prompt(model_dir), max_tokens=20, min_tokens=10, structured_output=choice
    )
    [sink] = run(engine, [params])
    assert sink.kind == INVALID
    assert sink.error == (
        f"{contract.STRUCTURED_OUTPUT}: no token fits: {contract.STRUCTURED_OUTPUT} and "
        f"{contract.MIN_TOKENS} together ban every id"
    )
    assert _text(sink) == "yes"


def test_a_grammar_is_compiled_once_then_cached(engine, model_dir) -> None:
    spec = StructuredOutput("choice", ("alpha", "beta"))
    prompt = _prompt(model_dir)
    for _ in range(3):
        run(engine, [GenerationParams(prompt_ids=prompt, max_tokens=8, structured_output=spec)])
    engine._publish_stats()
    assert (engine.stats.grammar_compiles, engine.stats.grammar_cache_hits) == (1, 2)
    assert engine.stats.grammar_compile_seconds > 0


def held_compiles(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, held: Callable[[StructuredOutput], bool]
) -> threading.Event:
    """Makes the compiles of the specs `held` picks wait until the returned event is set."""
    release = threading.Event()
    compiler = engine._grammar_compiler()
    build = compiler._build

    def build_when_released(spec: StructuredOutput):  # type: ignore[no-untyped-def]
        if held(spec):
            release.wait(WAIT_S)
        return build(spec)

    monkeypatch.setattr(compiler, "_build", build_when_released)
    return release


def test_a_compile_past_the_limit_is_refused_and_others_are_served(
    runner, model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(runner, grammar_compile_timeout_s=0.2)
    release = held_compiles(engine, monkeypatch, lambda spec: True)
    engine.start()
    try:
        prompt = _prompt(model_dir)
        slow, free = RecordingSink(), RecordingSink()
        spec = SPECS["regex"]
        run(
            engine,
            [
                GenerationParams(prompt_ids=prompt, max_tokens=8, structured_output=spec),
                GenerationParams(prompt_ids=prompt, max_tokens=8, temperature=0.0),
            ],
            [slow, free],
        )
        assert slow.kind == INVALID and "took longer than 0.2 s" in (slow.error or "")
        assert free.error is None and len(free.token_ids) == 8
        release.set()  # the compile ends; its grammar is cached for the next request
        [again] = run(
            engine, [GenerationParams(prompt_ids=prompt, max_tokens=8, structured_output=spec)]
        )
        assert again.error is None and conforms("regex", _text(again))
    finally:
        release.set()
        engine.stop()


def test_a_spec_that_waited_on_busy_compile_threads_is_refused_as_busy(
    runner, model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other requests' slow specs hold every compile thread past the limit: the waiting one is
    told the server is busy (UNAVAILABLE, retryable), not that its spec is at fault."""
    engine = Engine(runner, grammar_compile_timeout_s=0.2)
    slow_specs = [StructuredOutput("regex", f"slow{i}") for i in range(COMPILE_THREADS)]
    release = held_compiles(engine, monkeypatch, lambda spec: spec in slow_specs)
    engine.start()
    try:
        prompt = _prompt(model_dir)
        slow = [RecordingSink() for _ in slow_specs]
        for spec, sink in zip(slow_specs, slow, strict=True):
            engine.submit(GenerationParams(prompt_ids=prompt, structured_output=spec), sink)
        waiting = RecordingSink()
        engine.submit(
            GenerationParams(prompt_ids=prompt, structured_output=SPECS["choice"]), waiting
        )
        assert waiting.done.wait(WAIT_S) and all(sink.done.wait(WAIT_S) for sink in slow)
        assert waiting.kind == BUSY and (waiting.error or "").startswith("server busy")
        assert {sink.kind for sink in slow} == {INVALID}  # theirs ran past the limit
    finally:
        release.set()
        engine.stop()


def test_a_slow_compile_does_not_hold_up_the_next_one(
    runner, model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request's schema that takes long to compile holds one worker; another request's
    grammar compiles beside it (not after it, where its deadline would pass)."""
    engine = Engine(runner, grammar_compile_timeout_s=300)
    slow_spec, fast_spec = SPECS["regex"], SPECS["choice"]
    release = held_compiles(engine, monkeypatch, lambda spec: spec == slow_spec)
    engine.start()
    try:
        prompt = _prompt(model_dir)
        slow, fast = RecordingSink(), RecordingSink()
        engine.submit(GenerationParams(prompt_ids=prompt, structured_output=slow_spec), slow)
        engine.submit(GenerationParams(prompt_ids=prompt, structured_output=fast_spec), fast)
        assert fast.done.wait(WAIT_S) and not slow.done.is_set()
        assert fast.error is None and conforms("choice", _text(fast))
        release.set()
        assert slow.done.wait(WAIT_S)
        assert slow.error is None and conforms("regex", _text(slow))
    finally:
        release.set()
        engine.stop()


class _FirstTokenOrder(RecordingSink):
    """Appends `name` to `order` at its first output; cancelled once `leave` is set."""

    def __init__(self, name: str, order: list[str], leave: threading.Event | None = None):
        super().__init__()
        self.name, self.order, self.leave = name, order, leave
        self._sent = threading.Condition()

    def send(self, output) -> None:  # type: ignore[no-untyped-def]
        if not self.outputs:
            self.order.append(self.name)
        with self._sent:
            super().send(output)
            self._sent.notify_all()

    def wait_for_outputs(self, count: int) -> bool:
        with self._sent:
            return self._sent.wait_for(lambda: len(self.outputs) >= count, WAIT_S)

    def is_cancelled(self) -> bool:
        return self.leave is not None and self.leave.is_set()


def test_a_compiled_request_keeps_its_place_behind_older_ones(
    model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """First come, first served, as vLLM keeps a request waiting for its grammar in its place:
    a request whose grammar compiled while it waited does not start before an older one."""
    engine = Engine(ModelRunner(str(model_dir), max_num_seqs=1, max_model_len=256))
    spec = StructuredOutput("choice", ("older", "newer"))
    release = held_compiles(engine, monkeypatch, lambda held: held == spec)
    engine.start()
    try:
        prompt = _prompt(model_dir)
        order: list[str] = []
        leave = threading.Event()
        busy = _FirstTokenOrder("busy", order, leave)  # holds the one slot until told to leave
        engine.submit(GenerationParams(prompt_ids=prompt, max_tokens=200, ignore_eos=True), busy)
        assert busy.wait_for_outputs(1)
        older, newer = _FirstTokenOrder("older", order), _FirstTokenOrder("newer", order)
        engine.submit(GenerationParams(prompt_ids=prompt, max_tokens=2, temperature=0.0), older)
        engine.submit(GenerationParams(prompt_ids=prompt, structured_output=spec), newer)
        # Two more of busy's steps: the engine has taken both in, `newer` still compiling.
        assert busy.wait_for_outputs(len(busy.outputs) + 2)
        release.set()
        engine._grammar_compiler().compile(spec).result(WAIT_S)  # compiled while it waits
        leave.set()
        assert older.done.wait(WAIT_S) and newer.done.wait(WAIT_S)
        assert busy.kind == CANCELLED
        assert order == ["busy", "older", "newer"]
    finally:
        release.set()
        engine.stop()


def test_a_cancelled_constrained_stream_frees_its_slot(runner, model_dir) -> None:
    engine = Engine(ModelRunner(str(model_dir), max_num_seqs=1, max_model_len=256))
    engine.start()
    try:
        endless = StructuredOutput("regex", "a{500}")  # no end within max_tokens
        prompt = _prompt(model_dir)
        cancelled, after = RecordingSink(cancel_after=3), RecordingSink()
        run(
            engine,
            [
                GenerationParams(
                    prompt_ids=prompt, max_tokens=200, ignore_eos=True, structured_output=endless
                ),
                GenerationParams(prompt_ids=prompt, max_tokens=5, temperature=0.0),
            ],
            [cancelled, after],
        )
    finally:
        engine.stop()
    assert cancelled.kind == CANCELLED and set(_text(cancelled)) == {"a"}
    assert after.error is None and len(after.token_ids) == 5
    assert engine.stats.active_sequences == 0


def _arrays(spec: str | None) -> dict[str, np.ndarray]:
    arrays = {contract.INPUT_IDS: np.array([1, 2, 3], dtype=np.int32)}
    if spec is not None:
        arrays[contract.STRUCTURED_OUTPUT] = np.array([spec.encode()], dtype=object)
    return arrays


def test_the_tensor_parses_into_the_spec() -> None:
    limits = EngineLimits(vocab_size=1024, max_model_len=64)
    for spec in SPECS.values():
        params = parse_request(_arrays(spec.to_json()), limits)
        assert params.structured_output == spec
    assert parse_request(_arrays(None), limits).structured_output is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not JSON"),
        ('["choice"]', "a JSON object is expected"),
        ('{"type": "xml", "value": "x"}', "`type` must be one of"),
        ('{"type": "choice", "value": []}', "`choice` must be a non-empty list"),
        ('{"type": "choice", "value": ["a", ""]}', "`choice` must be a non-empty list"),
        ('{"type": "choice", "value": {"yes": 1}}', "`choice` must be a non-empty list"),
        ('{"type": "choice", "value": "yes"}', "`choice` must be a non-empty list"),
        # too deep for Python's json, within MAX_STRUCTURED_OUTPUT_CHARS
        ('{"type": "json", "value": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
        (
            '{"type": "json", "value": ' + '{"items": ' * 20_000 + "{}" + "}" * 20_001,
            "nested too deeply",
        ),
        ('{"type": "regex", "value": ""}', "`regex` must be a non-empty string"),
        ('{"type": "json", "value": 3}', "a JSON schema is an object or a boolean"),
        ('{"type": "json_object", "value": "x"}', "`json_object` takes no `value`"),
        ('{"type": "regex", "value": "a", "extra": 1}', "unknown keys ['extra']"),
        ('{"type": "regex", "value": "a", "disable_any_whitespace": 1}', "must be a boolean"),
        (
            '{"type": "choice", "value": ["' + "a" * contract.MAX_STRUCTURED_OUTPUT_CHARS + '"]}',
            f"characters, at most {contract.MAX_STRUCTURED_OUTPUT_CHARS}",
        ),
    ],
)
def test_a_malformed_tensor_is_invalid_input(text: str, message: str) -> None:
    limits = EngineLimits(vocab_size=1024, max_model_len=64)
    with pytest.raises(InvalidInputError) as error:
        parse_request(_arrays(text), limits)
    assert error.value.parameter == contract.STRUCTURED_OUTPUT
    assert message in str(error.value)


UNENFORCED = [  # (schema, an instance it refuses, what the 400 names)
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [2, 2], "`uniqueItems`"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 4}}, [5], "`contains`"),
    ({"not": {"type": "boolean"}}, True, "the schema: `not`"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, 3, "the schema: `if`"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, 3, "`allOf` of more than one schema"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "aaaa", "`pattern` with"),
    ({"type": "string", "pattern": "^(?!x)[a-z]$"}, "x", "a lookahead or lookbehind in"),
    ({"type": "number", "multipleOf": 0.5}, 1.3, "`multipleOf` other than"),
    (
        {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": {}, "uniqueItems": True}},
        },
        {"tags": [1, 1]},
        "properties.tags: `uniqueItems`",
    ),
    (
        {"$defs": {"n": {"not": {"const": 1}}}, "anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]},
        1,
        "$defs.n: `not`",
    ),
    ({"type": "object", "required": ["answer"]}, {}, "`required` 'answer', which `properties`"),
    ({"allOf": [{"type": "object", "required": ["a"]}]}, {}, "allOf.0: `required` 'a'"),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "anyOf": [{"required": ["a"]}],
        },
        {},
        "`anyOf` beside `properties`",
    ),
    (
        {"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p", "minimum": 1000},
        97,
        "`$ref` beside",
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        {"a": 1},
        "`dependentRequired`",
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "dependentSchemas": {"a": {"required": ["b"]}},
        },
        {"a": 1},
        "`dependentSchemas`",
    ),
    ({"minimum": 5}, 1, "`minimum` without a `type`"),
    ({"maxLength": 2}, "abc", "`maxLength` without a `type`"),
]


@pytest.mark.parametrize(("schema", "instance", "named"), UNENFORCED)
def test_what_xgrammar_does_not_enforce_is_refused(schema: dict, instance, named: str) -> None:
    """xgrammar 0.2.9 compiles each of these and accepts an output that breaks it (checked
    here, so that a version that enforces one shows it can leave the list); the spec refuses
    them, as the docs promise the schema holds."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(instance, schema)
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, json.dumps(instance))
    with pytest.raises(ValueError, match="asks for what the grammar cannot hold") as refused:
        StructuredOutput.json_schema(schema)
    assert named in str(refused.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
        {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "integer"}}},
        {"type": "integer", "multipleOf": 7},
        {"type": "string", "format": "mycustom"},  # an annotation, as in JSON Schema 2020-12
        {"enum": [{"not": 1}, {"uniqueItems": True}]},  # values, not schemas
        # as pydantic writes them: an optional bounded field, a described model field, a
        # discriminated union
        {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}], "default": None},
        {"$ref": "#/$defs/M", "description": "d", "$defs": {"M": {"type": "object"}}},
        {
            "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
            "discriminator": {"propertyName": "kind"},
            "$defs": {
                "A": {
                    "type": "object",
                    "properties": {"kind": {"const": "a"}},
                    "required": ["kind"],
                },
                "B": {
                    "type": "object",
                    "properties": {"kind": {"const": "b"}},
                    "required": ["kind"],
                },
            },
        },
        {"enum": ["x", "y"], "maxLength": 1},
        # pydantic's HttpUrl: xgrammar's `uri` cannot be empty, and drops the 2083 (see docs)
        {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
        {"type": "string", "pattern": "^\\(?=[a-z]+$"},  # an escaped "(", then "="
        {"type": "string", "pattern": "^[(?=]+$"},  # a character class
    ],
)
def test_what_xgrammar_enforces_is_accepted(schema: dict) -> None:
    assert json.loads(StructuredOutput.json_schema(schema).value) == schema


def test_an_external_ref_is_refused() -> None:
    with pytest.raises(ValueError, match="`\\$ref` outside the schema"):
        StructuredOutput.json_schema({"$ref": "https://example.com/s.json"})


def test_a_schema_too_deep_to_write_is_refused() -> None:
    """Deeper than Python's json can write (the adapter's schema objects come this way)."""
    schema: dict = {}
    for _ in range(100_000):
        schema = {"items": schema}
    with pytest.raises(ValueError, match="the JSON schema: it is nested too deeply"):
        StructuredOutput.json_schema(schema)


def test_the_server_wide_whitespace_switch_equals_the_request_flag(runner, model_dir) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    prompt = _prompt(model_dir)

    def tokens(engine: Engine, spec: StructuredOutput) -> list[int]:
        engine.start()
        try:
            params = GenerationParams(
                prompt_ids=prompt, max_tokens=24, temperature=0.0, structured_output=spec
            )
            [sink] = run(engine, [params])
        finally:
            engine.stop()
        assert sink.error is None
        return sink.token_ids

    server_wide = tokens(
        Engine(runner, grammar_disable_any_whitespace=True), StructuredOutput.json_schema(schema)
    )
    asked = tokens(
        Engine(runner), StructuredOutput.json_schema(schema, disable_any_whitespace=True)
    )
    free = tokens(Engine(runner), StructuredOutput.json_schema(schema))
    assert server_wide == asked
    assert server_wide != free  # whitespace allowed: this model then takes it
