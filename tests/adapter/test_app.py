"""Health, models, error objects and the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from adapter.__main__ import parse_args
from adapter.app import create_app
from adapter.errors import EngineError, EngineUnavailableError
from adapter.settings import AdapterSettings
from tests.adapter.fakes import FakeEngine

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_health(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}


def documented_statuses(client: TestClient, path: str) -> set[str]:
    """The statuses the OpenAPI schema lists for GET `path`."""
    return set(client.get("/openapi.json").json()["paths"][path]["get"]["responses"])


def test_ready(engine: FakeEngine, client: TestClient) -> None:
    assert client.get("/health/ready").json() == {"status": "ready"}
    engine.ready = False
    response = client.get("/health/ready")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "service_unavailable"
    assert documented_statuses(client, "/health/ready") == {"200", "500", "503"}


def test_models(client: TestClient) -> None:
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list"
    [card] = listing["data"]
    assert (card["id"], card["object"], card["root"], card["max_model_len"]) == (
        "tiny",
        "model",
        "/models/tiny",
        64,
    )
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    assert documented_statuses(client, "/v1/models") == {"200", "401", "500", "503"}
    assert documented_statuses(client, "/v1/models/{model_id}") == {
        "200",
        "401",
        "404",
        "500",
        "503",
    }


def test_served_name_defaults_to_the_model_folder() -> None:
    app = create_app(AdapterSettings(), engine=FakeEngine())
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert response.status_code == 500  # the fake's script is empty: no final response
        assert "before the final response" in response.json()["error"]["message"]


def test_triton_unreachable_is_503(engine: FakeEngine, client: TestClient) -> None:
    engine.reachable = False
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_error"
    assert response.headers["retry-after"] == "1"  # the launcher restarts a faulty Triton


@pytest.mark.parametrize(
    ("error", "status"), [(EngineUnavailableError("model gone"), 503), (EngineError("bug"), 500)]
)
def test_engine_errors_are_error_objects(
    engine: FakeEngine, client: TestClient, error: Exception, status: int
) -> None:
    engine.script = [error]
    response = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
    )
    assert response.status_code == status
    assert response.json()["error"]["message"] == str(error)


def test_unknown_route_is_an_error_object(client: TestClient) -> None:
    response = client.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Not Found"


def test_a_wrong_method_is_a_405_error_object_with_allow(client: TestClient) -> None:
    response = client.post("/health")
    assert response.status_code == 405
    assert response.headers["allow"] == "GET"
    assert response.json()["error"]["message"] == "Method Not Allowed"


def test_cli_overrides_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTER_PORT", "9100")
    monkeypatch.setenv("ADAPTER_TRITON_URL", "triton:8001")
    overrides = parse_args(["--port", "9200", "--served-model-name", "m", "--log-level", "debug"])
    assert overrides == {"port": 9200, "served_model_name": "m", "log_level": "debug"}
    settings = AdapterSettings(**overrides)
    assert (settings.port, settings.triton_url, settings.served_model_name) == (
        9200,
        "triton:8001",
        "m",
    )
    assert AdapterSettings().port == 9100


@pytest.mark.parametrize(("flag", "value"), [("false", False), ("0", False), ("true", True)])
def test_a_boolean_flag_reads_its_text(flag: str, value: bool) -> None:
    settings = AdapterSettings(**parse_args(["--local-preprocessing", flag]))
    assert settings.local_preprocessing is value


def test_a_bug_is_a_500_error_object(engine: FakeEngine) -> None:
    engine.script = [RuntimeError("unexpected")]
    app = create_app(AdapterSettings(served_model_name="tiny"), engine=engine)
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": "unexpected",
        "type": "server_error",
        "param": None,
        "code": None,
    }


def test_the_adapter_never_imports_torch_or_transformers() -> None:
    """The adapter runs beside Triton in a slim image: a fresh interpreter proves the imports."""
    code = (
        "import sys, adapter.__main__; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    )
    assert result.stdout.strip() == "[]"
