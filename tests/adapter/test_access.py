"""The API key: every API route refuses a missing or wrong key with a 401 error object;
health, the schema and (without its own key) /metrics stay open."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from adapter import access
from adapter.access import PathKind, path_kind
from adapter.app import create_app
from adapter.settings import AdapterSettings
from tests.adapter.fakes import FakeEngine, model_script

KEY = "sk-test-key"
MESSAGES = [{"role": "user", "content": "hi"}]
# Every API route with a body it accepts; the last is unknown (a 404 once past the key).
API_REQUESTS = [
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny", None),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [97]}),
    ("POST", "/generative_scoring", {"query": "q", "items": ["i"], "label_token_ids": [1]}),
    ("GET", "/v1/nothing", None),
]
WRONG = [None, "Bearer sk-wrong", f"Basic {KEY}", "Bearer", f"bearer {KEY}x"]


@pytest.fixture
def keyed(engine: FakeEngine) -> Iterator[TestClient]:
    engine.respond = model_script
    settings = AdapterSettings(served_model_name="tiny", api_key=KEY, metrics_api_key="sk-prom")
    with TestClient(create_app(settings, engine=engine)) as client:
        yield client


def call(client: TestClient, method: str, path: str, body: dict | None, authorization: str | None):
    headers = {} if authorization is None else {"Authorization": authorization}
    return client.request(method, path, json=body, headers=headers)


def test_every_api_route_is_in_the_list(keyed: TestClient) -> None:
    """A new route under /v1 or vLLM's paths must join API_REQUESTS (and so these tests)."""
    paths = keyed.get("/openapi.json").json()["paths"]
    routes = {
        (method.upper(), path)
        for path, operations in paths.items()
        if path_kind(path) is PathKind.API
        for method in operations
    }
    tested = {(method, path.replace("/tiny", "/{model_id}")) for method, path, _ in API_REQUESTS}
    assert routes == tested - {("GET", "/v1/nothing")}


@pytest.mark.parametrize(("method", "path", "body"), API_REQUESTS)
@pytest.mark.parametrize("authorization", WRONG)
def test_api_routes_refuse_a_missing_or_wrong_key(
    engine: FakeEngine,
    keyed: TestClient,
    method: str,
    path: str,
    body: dict | None,
    authorization: str | None,
) -> None:
    response = call(keyed, method, path, body, authorization)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_api_key",
        None,
    )
    assert KEY not in error["message"]
    assert engine.requests == engine.tokenized == []  # refused before any work


@pytest.mark.parametrize(("method", "path", "body"), API_REQUESTS[:-1])
def test_the_schema_says_api_routes_may_answer_401(
    keyed: TestClient, method: str, path: str, body: dict | None
) -> None:
    operation = keyed.get("/openapi.json").json()["paths"][path.replace("/tiny", "/{model_id}")]
    assert "401" in operation[method.lower()]["responses"]


@pytest.mark.parametrize(("method", "path", "body"), API_REQUESTS)
def test_api_routes_serve_the_right_key(
    keyed: TestClient, method: str, path: str, body: dict | None
) -> None:
    response = call(keyed, method, path, body, f"Bearer {KEY}")
    assert response.status_code == (404 if path == "/v1/nothing" else 200), response.text


@pytest.mark.parametrize("path", ["/health", "/health/ready", "/openapi.json", "/docs"])
def test_health_and_the_schema_need_no_key(keyed: TestClient, path: str) -> None:
    assert keyed.get(path).status_code == 200


def test_metrics_have_their_own_key(keyed: TestClient) -> None:
    assert keyed.get("/metrics").status_code == 401
    assert keyed.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 401
    assert keyed.get("/metrics", headers={"Authorization": "Bearer sk-prom"}).status_code == 200


def test_without_keys_everything_is_open(client: TestClient) -> None:
    assert client.get("/v1/models").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_the_key_is_compared_in_constant_time(
    keyed: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = access.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(access.hmac, "compare_digest", spy)
    assert keyed.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert compared == [(b"nope", KEY.encode())]


def test_the_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTER_API_KEY", KEY)
    settings = AdapterSettings()
    assert settings.api_key is not None and settings.api_key.get_secret_value() == KEY
    assert KEY not in repr(settings)  # a SecretStr: not in logs or tracebacks
    monkeypatch.setenv("ADAPTER_API_KEY", "")  # compose passes an unset variable as empty
    assert AdapterSettings().api_key is None
