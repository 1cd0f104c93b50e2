"""`response_format` and `structured_outputs` -> the STRUCTURED_OUTPUT tensor, on both endpoints,
with `n` and streaming; each bad form's 400; a model-side compile error named by its field."""

from __future__ import annotations

import json
from typing import Literal

import numpy as np
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from pydantic import BaseModel

from adapter.errors import TritonInputError
from adapter.tensors import TritonRequest, llm_inputs
from backend import contract
from backend.structured_output import StructuredOutput
from tests.adapter.fakes import FakeEngine, model_script, output

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def body(path: str, **fields: object) -> dict[str, object]:
    prompt = (
        {"prompt": "Hello"}
        if path == COMPLETIONS
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    return {"model": "tiny", **prompt, **fields}


@pytest.fixture(autouse=True)
def _one_token(engine: FakeEngine) -> None:
    engine.script = [output(tokens=[(7, b"!", -0.5)], finish_reason="stop", completion_tokens=1)]


def _sent(engine: FakeEngine) -> list[dict]:
    """The STRUCTURED_OUTPUT tensor of every request the engine got, parsed."""
    sent = []
    for params, _ in engine.requests:
        arrays = llm_inputs(params, [1, 2])
        tensor = arrays.get(contract.STRUCTURED_OUTPUT)
        sent.append(None if tensor is None else json.loads(tensor[0].decode()))
    return sent


ACCEPTED = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"type": "json_object"}),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
            }
        },
        {"type": "json", "value": SCHEMA},
    ),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"type": "choice", "value": ["yes", "no"]}),
    ({"structured_outputs": {"regex": "[0-9]+"}}, {"type": "regex", "value": "[0-9]+"}),
    (
        {"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
        {"type": "json", "value": SCHEMA, "disable_any_whitespace": True},
    ),
    ({"structured_outputs": {"json": SCHEMA}}, {"type": "json", "value": SCHEMA}),
    (
        {"structured_outputs": {"grammar": 'root ::= "a"'}},
        {"type": "grammar", "value": 'root ::= "a"'},
    ),
    ({"structured_outputs": {"json_object": True}}, {"type": "json_object"}),
]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(("fields", "tensor"), ACCEPTED)
@pytest.mark.parametrize("stream", [False, True])
def test_each_form_becomes_the_tensor_for_every_choice(
    client: TestClient,
    engine: FakeEngine,
    path: str,
    fields: dict,
    tensor: dict | None,
    stream: bool,
) -> None:
    response = client.post(path, json=body(path, n=2, stream=stream, **fields))
    assert response.status_code == 200, response.text
    assert _sent(engine) == [tensor, tensor]


BAD = [
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    (
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
        "got 2 (regex, choice)",
    ),
    (  # json_object false is a kind given, as in vLLM: it used to pass beside another
        {"structured_outputs": {"regex": "a", "json_object": False}},
        "structured_outputs",
        "got 2 (regex, json_object)",
    ),
    (
        {"structured_outputs": {"json_object": False}},
        "structured_outputs",
        "`structured_outputs.json_object: false` constrains nothing",
    ),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    (
        {"structured_outputs": {"regex": "a", "disable_any_whitepsace": True}},
        "structured_outputs",
        "`structured_outputs.disable_any_whitepsace` is not a field",
    ),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs", "non-empty list"),
    (
        {"structured_outputs": {"json": "{not json"}},
        "structured_outputs",
        "`structured_outputs.json` is not valid JSON: Expecting property name",
    ),
    (
        {"structured_outputs": {"json": '{"items": ' * 100_000 + "{}" + "}" * 100_000}},
        "structured_outputs",
        "`structured_outputs.json`: it is nested too deeply.",
    ),
    (
        {"structured_outputs": {"json": {"type": "array", "items": {}, "uniqueItems": True}}},
        "structured_outputs",
        "asks for what the grammar cannot hold: the schema: `uniqueItems`",
    ),
    (  # a property name that is no string: it used to be a 500 (a TypeError)
        {"structured_outputs": {"json": {"properties": {"a": {}}, "required": [["a"]]}}},
        "structured_outputs",
        "cannot hold: the schema: `required` ['a'], which `properties` does not define",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"not": {"type": "null"}}},
            }
        },
        "response_format",
        "`response_format`: the JSON schema asks for what the grammar cannot hold",
    ),
    *[
        (
            {"structured_outputs": {"json": schema}},
            "structured_outputs",
            f"`structured_outputs.json` must be a JSON schema object, got {kind}.",
        )
        for schema, kind in [
            ("[1]", "array"),
            ("true", "boolean"),
            ("null", "null"),
            ('"{}"', "string"),
            (True, "boolean"),
            (3, "number"),
            ([SCHEMA], "array"),
        ]
    ],
    (
        {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
        "structured_outputs",
        "`structured_outputs.whitespace_pattern` is not supported by this server (got ' '; "
        "only null).",
    ),
    (
        {"structured_outputs": {"choice": ["a"], "disable_fallback": True}},
        "structured_outputs",
        "`structured_outputs.disable_fallback` is not supported by this server (got True; "
        "only False).",
    ),
    (
        {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
        "structured_outputs",
        "`structured_outputs.disable_additional_properties` is not supported",
    ),
    (
        {"structured_outputs": {"regex": "a", "structural_tag": "{}"}},
        "structured_outputs",
        "`structured_outputs.structural_tag` is not supported",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs `json_schema.schema`"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        '`response_format` of type "json_schema" needs `json_schema.schema`.',
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        "response_format",
        "`response_format.json_schema.name` must be a string.",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
        "response_format",
        "`response_format.json_schema.schema` must be a JSON schema object, got array.",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}},
        "response_format",
        "`response_format.json_schema.schema` must be a JSON schema object, got boolean.",
    ),
    (
        {"response_format": {"type": "xml"}},
        "response_format",
        '`response_format.type` must be one of "text", "json_object", "json_schema"; got \'xml\'.',
    ),
    ({"response_format": {}}, "response_format", "`response_format.type` must be one of"),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
        "not both",
    ),
    ({"guided_regex": "a"}, "guided_regex", "is not supported"),
]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(("fields", "param", "message"), BAD)
def test_bad_forms_are_400s_naming_the_field(
    client: TestClient, engine: FakeEngine, path: str, fields: dict, param: str, message: str
) -> None:
    response = client.post(path, json=body(path, **fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and message in error["message"], error
    assert engine.requests == []


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_compile_error_from_the_model_names_the_field_used(
    client: TestClient, engine: FakeEngine, path: str, fields: dict, param: str, stream: bool
) -> None:
    engine.script = [TritonInputError(contract.STRUCTURED_OUTPUT, "regex does not compile: x")]
    response = client.post(path, json=body(path, stream=stream, **fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"] == f"{param}: regex does not compile: x"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_the_inputs_an_engine_error_names_become_the_request_fields(
    client: TestClient, engine: FakeEngine, path: str, fields: dict, param: str
) -> None:
    """The engine names Triton inputs; the client reads the fields it sent."""
    engine.script = [
        TritonInputError(
            contract.STRUCTURED_OUTPUT,
            "no token fits: STRUCTURED_OUTPUT, MIN_TOKENS and ALLOWED_TOKEN_IDS together ban "
            "every id (UTF-8, EOS)",
        )
    ]
    response = client.post(path, json=body(path, **fields))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == (
        f"{param}: no token fits: `{param}`, `min_tokens` and `allowed_token_ids` together ban "
        "every id (UTF-8, EOS)"
    )


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_user_text_in_a_model_error_is_not_renamed(
    client: TestClient, engine: FakeEngine, path: str
) -> None:
    """Only the input names of "no token fits" are the model's own: a grammar's rule `STOP`
    (also an input's name) stays as the user wrote it (a review)."""
    detail = 'grammar does not compile: Rule "STOP" is not defined'
    engine.script = [TritonInputError(contract.STRUCTURED_OUTPUT, detail)]
    fields = {"structured_outputs": {"grammar": 'root ::= STOP\nstop ::= "x"'}}
    response = client.post(path, json=body(path, **fields))
    assert response.json()["error"]["message"] == f"structured_outputs: {detail}"


def test_the_tensor_is_bytes_of_one_json_spec() -> None:
    spec = StructuredOutput("choice", ("ja", "nein"))
    arrays = llm_inputs(TritonRequest(prompt_ids=(1,), structured_output=spec), [1])
    tensor = arrays[contract.STRUCTURED_OUTPUT]
    assert tensor.dtype == np.object_ and tensor.shape == (1,)
    assert StructuredOutput.from_json(tensor[0].decode()) == spec


def test_the_openapi_schema_tells_the_response_formats_apart(client: TestClient) -> None:
    """Clients and fuzzers read a discriminated union: each `type` with its own fields."""
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        union, null = schemas[request]["properties"]["response_format"]["anyOf"]
        assert null == {"type": "null"}
        assert union["discriminator"] == {
            "propertyName": "type",
            "mapping": {
                kind: f"#/components/schemas/{model}"
                for kind, model in [
                    ("json_object", "ResponseFormatJsonObject"),
                    ("json_schema", "ResponseFormatJsonSchema"),
                    ("text", "ResponseFormatText"),
                ]
            },
        }
    assert schemas["ResponseFormatJsonSchema"]["required"] == ["type", "json_schema"]
    assert schemas["JsonSchemaFormat"]["required"] == ["name", "schema"]


class Verdict(BaseModel):
    label: Literal["yes", "no"]
    score: int


def test_the_sdk_parse_into_a_pydantic_model(client: TestClient, engine: FakeEngine) -> None:
    """`client.beta.chat.completions.parse(response_format=Model)` sends a strict json_schema
    (`name`, `schema`, `strict: true`, `stream: false`) and parses the reply into the model."""
    engine.script = [output(text='{"label": "yes", "score": 3}', finish_reason="stop")]
    sdk = OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    reply = sdk.beta.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], response_format=Verdict
    )
    assert reply.choices[0].message.parsed == Verdict(label="yes", score=3)
    [(params, _)] = engine.requests
    assert params.structured_output is not None
    sent = json.loads(params.structured_output.value)
    assert sent == {
        "additionalProperties": False,
        "properties": {
            "label": {"enum": ["yes", "no"], "title": "Label", "type": "string"},
            "score": {"title": "Score", "type": "integer"},
        },
        "required": ["label", "score"],
        "title": "Verdict",
        "type": "object",
    }


def test_a_schema_is_sent_in_the_client_s_key_order(client: TestClient, engine: FakeEngine) -> None:
    """The output's properties follow the schema's order, as in vLLM and OpenAI: a
    `reasoning` declared before `answer` is written first. So the schema is not sorted on its
    way, whichever field sent it (an audit saw the properties come out sorted)."""
    schema = {
        "type": "object",
        "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
        "required": ["reasoning", "answer"],
    }
    requests = [
        (COMPLETIONS, {"structured_outputs": {"json": schema}}),
        (COMPLETIONS, {"structured_outputs": {"json": json.dumps(schema)}}),
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": schema, "strict": None},
                }
            },
        ),
    ]
    for path, fields in requests:
        assert client.post(path, json=body(path, **fields)).status_code == 200
    texts = [
        llm_inputs(params, [1])[contract.STRUCTURED_OUTPUT][0].decode()
        for params, _ in engine.requests
    ]
    assert texts == [json.dumps({"type": "json", "value": schema})] * 3


def test_every_prompt_and_sample_of_a_batch_gets_the_spec(
    client: TestClient, engine: FakeEngine
) -> None:
    fields = {"prompt": ["a", "b"], "n": 2, "structured_outputs": {"choice": ["yes", "no"]}}
    response = client.post(COMPLETIONS, json=body(COMPLETIONS, **fields))
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2, 3]
    assert sorted(params.text for params, _ in engine.requests) == ["a", "a", "b", "b"]
    assert _sent(engine) == [{"type": "choice", "value": ["yes", "no"]}] * 4


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_and_echo_go_with_the_spec(
    client: TestClient, engine: FakeEngine, stream: bool
) -> None:
    """The logprobs stay the model's business (raw, before the mask): the request keeps them."""
    engine.respond = model_script
    fields = {
        "prompt": [5, 6],
        "echo": True,
        "logprobs": 1,
        "logprob_token_ids": [3, 4],
        "stream": stream,
        "structured_outputs": {"regex": "[ab]+"},
    }
    response = client.post(COMPLETIONS, json=body(COMPLETIONS, **fields))
    assert response.status_code == 200, response.text
    [(params, _)] = engine.requests
    assert (params.logprobs, params.logprob_token_ids, params.prompt_logprobs) == (0, (3, 4), 1)
    assert params.structured_output == StructuredOutput("regex", "[ab]+")
