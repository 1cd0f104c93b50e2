"""The `STRUCTURED_OUTPUT` input: which shape a request's output must take, as JSON both sides
read and write (docs/tensors.md). Imports nothing heavy: the adapter builds it, the engine
parses it and compiles it (`backend.grammar`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CHOICE = "choice"
REGEX = "regex"
JSON = "json"
JSON_OBJECT = "json_object"
GRAMMAR = "grammar"
KINDS = (CHOICE, REGEX, JSON, JSON_OBJECT, GRAMMAR)
TOO_DEEP = "it is nested too deeply"
"""What a JSON text or object too deep for Python's json (a RecursionError) is told."""


_SUBSCHEMA = (
    "items",
    "additionalProperties",
    "additionalItems",
    "propertyNames",
    "contains",
    "unevaluatedProperties",
    "unevaluatedItems",
    "not",
    "if",
    "then",
    "else",
)
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_UNENFORCED = (
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$comment",
        "$schema",
        "$id",
        "$anchor",
        "$defs",
        "definitions",
        "discriminator",
    }
)
"""Keywords that assert nothing (OpenAPI's `discriminator`, which pydantic writes beside `oneOf`,
included): beside `$ref`, `anyOf` or `oneOf`, these are all xgrammar keeps."""
_TYPE_BOUNDS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
)
"""Bounds of one JSON type, which xgrammar applies only under that `type`."""


def _has_lookaround(pattern: str) -> bool:
    """Whether `pattern` holds a group `(?=`, `(?!`, `(?<=` or `(?<!`, which xgrammar drops
    from a schema's `pattern` with a warning (the `regex` kind refuses them); an escaped
    parenthesis and one inside a character class are plain characters."""
    in_class, i = False, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":
            in_class = True
        elif char == "]":
            in_class = False
        elif char == "(" and not in_class and pattern.startswith(("?=", "?!", "?<=", "?<!"), i + 1):
            return True
        i += 1
    return False


def unenforced_keyword(schema: Any, path: str = "") -> str | None:
    """The first assertion of `schema` that xgrammar's grammar would not hold the output to,
    as "where: what", or None. Measured on xgrammar 0.2.9 (docs/design.md, "Structured
    outputs"): it compiles these and lets outputs that break them through, so they are refused
    rather than promised. `oneOf` is read as `anyOf` (left served: pydantic writes it for
    unions whose branches cannot overlap), and `format` and `content*` are annotations in JSON
    Schema 2020-12; xgrammar holds some of them anyway, which only narrows the output."""
    if not isinstance(schema, dict):
        return None
    where = path or "the schema"
    for keyword in _UNENFORCED:
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            return f"{where}: `{keyword}`"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"{where}: `allOf` of more than one schema"
    for combinator in ("$ref", "anyOf", "oneOf"):
        beside = sorted(set(schema) - _ANNOTATIONS - {combinator})
        if combinator in schema and beside:
            return f"{where}: `{combinator}` beside `{beside[0]}`"
    if "type" not in schema and "enum" not in schema and "const" not in schema:
        bound = next((keyword for keyword in _TYPE_BOUNDS if keyword in schema), None)
        if bound is not None:
            return f"{where}: `{bound}` without a `type`"
    required = schema.get("required")
    if isinstance(required, list):
        defined = schema.get("properties")
        missing = [
            n
            for n in required
            if not isinstance(n, str) or not isinstance(defined, dict) or n not in defined
        ]
        if missing:
            return f"{where}: `required` {missing[0]!r}, which `properties` does not define"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return f"{where}: `pattern` with `minLength` or `maxLength`"
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and _has_lookaround(pattern):
        return f"{where}: a lookahead or lookbehind in `pattern`"
    step = schema.get("multipleOf")
    if step is not None and not (schema.get("type") == "integer" and isinstance(step, int)):
        return f"{where}: `multipleOf` other than an integer's integer step"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"{where}: `$ref` outside the schema ({ref!r})"
    children: list[tuple[str, Any]] = [(key, schema.get(key)) for key in _SUBSCHEMA]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += [(f"{key}.{i}", item) for i, item in enumerate(schema[key])]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += [(f"{key}.{name}", item) for name, item in schema[key].items()]
    for key, child in children:
        found = unenforced_keyword(child, f"{path}.{key}" if path else key)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class StructuredOutput:
    """`value`: the choices (a tuple of strings), the regex, the JSON schema (as JSON text in
    the schema's own key order, which the output's properties follow, as in vLLM and OpenAI) or
    the EBNF grammar; "" for `json_object`."""

    kind: str
    value: Any
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"`type` must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.kind == CHOICE:
            strings = isinstance(self.value, tuple) and all(
                isinstance(c, str) and c for c in self.value
            )
            if not self.value or not strings:
                raise ValueError("`choice` must be a non-empty list of non-empty strings")
        elif self.kind in (REGEX, GRAMMAR):
            if not isinstance(self.value, str) or not self.value:
                raise ValueError(f"`{self.kind}` must be a non-empty string")
        elif self.kind == JSON and not isinstance(self.value, str):
            raise ValueError("a JSON schema is held as JSON text")

    @classmethod
    def json_schema(cls, schema: Any, disable_any_whitespace: bool = False) -> StructuredOutput:
        if not isinstance(schema, dict | bool):
            kind = type(schema).__name__
            raise ValueError(f"a JSON schema is an object or a boolean, got {kind}")
        try:
            text = json.dumps(schema)
            unenforced = unenforced_keyword(schema)
        except RecursionError:
            raise ValueError(f"the JSON schema: {TOO_DEEP}") from None
        if unenforced is not None:
            raise ValueError(f"the JSON schema asks for what the grammar cannot hold: {unenforced}")
        return cls(JSON, text, disable_any_whitespace)

    def to_json(self) -> str:
        body: dict[str, Any] = {"type": self.kind}
        if self.kind == CHOICE:
            body["value"] = list(self.value)
        elif self.kind == JSON:
            body["value"] = json.loads(self.value)
        elif self.kind != JSON_OBJECT:
            body["value"] = self.value
        if self.disable_any_whitespace:
            body["disable_any_whitespace"] = True
        return json.dumps(body)

    @classmethod
    def from_json(cls, text: str) -> StructuredOutput:
        """Raises ValueError with a message for the caller (INVALID_ARG in Triton)."""
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        except RecursionError:
            raise ValueError(TOO_DEEP) from None
        if not isinstance(body, dict):
            raise ValueError('a JSON object is expected: {"type": ..., "value": ...}')
        unknown = sorted(set(body) - {"type", "value", "disable_any_whitespace"})
        if unknown:
            raise ValueError(f"unknown keys {unknown}")
        kind, value = str(body.get("type")), body.get("value")
        whitespace = body.get("disable_any_whitespace", False)
        if not isinstance(whitespace, bool):
            raise ValueError("`disable_any_whitespace` must be a boolean")
        if kind == JSON:
            return cls.json_schema(value, whitespace)
        if kind == JSON_OBJECT:
            if value is not None:
                raise ValueError("`json_object` takes no `value`")
            return cls(JSON_OBJECT, "", whitespace)
        if kind == CHOICE:  # a list only: a string or an object would iterate as choices
            value = tuple(value) if isinstance(value, list) else None
        return cls(kind, value, whitespace)
