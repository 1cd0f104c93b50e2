"""docker/compose.yaml: docker-compose accepts it, and what it resolves to is the intended stack.

`docker-compose config` parses, validates against the Compose schema and interpolates the file
without a Docker engine. Debian bookworm's docker-compose is 1.29.2 (the Python v1); the file
uses only what that version and the Compose v2 plugin both accept; the helpers below read both
versions' output (v1's short strings, v2's long mappings).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.deploy.tools import DOCKER_DIR, REPO_ROOT, run, tool

COMPOSE_FILE = DOCKER_DIR / "compose.yaml"


def compose(*args: str, **env: str):
    """docker-compose on the file, in an environment with none of the file's variables set."""
    clean = {k: v for k, v in os.environ.items() if k.startswith(("PATH", "HOME", "LANG", "LC_"))}
    return run([tool("docker-compose"), "--file", str(COMPOSE_FILE), *args], env={**clean, **env})


def resolved(**env: str) -> dict:
    result = compose("config", **env)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def port_bindings(service: dict) -> set[tuple[str, int, int]]:
    """(host address or "", published port, container port) of each published port."""
    bindings = set()
    for port in service.get("ports", []):
        if isinstance(port, dict):
            bindings.add((port.get("host_ip", ""), int(port["published"]), int(port["target"])))
        else:
            parts = port.split("/")[0].split(":")
            host = parts[0] if len(parts) == 3 else ""
            bindings.add((host, int(parts[-2]), int(parts[-1])))
    return bindings


def mounts(service: dict) -> set[tuple[str, str]]:
    """(source, target) of each volume."""
    out = set()
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            out.add((volume["source"], volume["target"]))
        else:
            source, target = volume.split(":")[:2]
            out.add((source, target))
    return out


def test_docker_compose_accepts_the_file() -> None:
    result = compose("config", "--quiet")
    assert result.returncode == 0, result.stderr
    # No warning either (an unset variable without a default, an unsupported key, ...).
    assert result.stderr.strip() == ""


def test_docker_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    """The validator is live: a misspelt key and a healthcheck without a test are refused."""
    broken = tmp_path / "compose.yaml"
    broken.write_text(
        "services:\n  triton:\n    image: x:1\n    depends_on:\n      adapter:\n"
        "        condition: service_healty\n  adapter:\n    image: y:1\n"
    )
    result = run([tool("docker-compose"), "--file", str(broken), "config", "--quiet"])
    assert result.returncode != 0
    assert "service_healty" in result.stderr


def test_services_images_and_build_contexts() -> None:
    services = resolved()["services"]
    assert set(services) == {"triton", "adapter"}
    for name in services:
        build = services[name]["build"]
        assert Path(build["context"]) == REPO_ROOT
        assert (REPO_ROOT / build["dockerfile"]).is_file()
        assert build["dockerfile"] == f"docker/{name}.Dockerfile"


def test_the_gpu_is_reserved_for_triton_only() -> None:
    services = resolved()["services"]
    (device,) = services["triton"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert device["count"] == 1
    assert "deploy" not in services["adapter"]


def test_health_checks_and_start_order() -> None:
    services = resolved()["services"]
    triton_check = " ".join(services["triton"]["healthcheck"]["test"])
    adapter_check = " ".join(services["adapter"]["healthcheck"]["test"])
    assert "http://127.0.0.1:8000/v2/health/ready" in triton_check
    assert "http://127.0.0.1:9000/health/ready" in adapter_check
    # Building the default model and loading a model take minutes on a first start.
    assert services["triton"]["healthcheck"]["start_period"] in ("15m", "15m0s")
    assert services["adapter"]["depends_on"]["triton"]["condition"] == "service_healthy"
    assert services["adapter"]["environment"]["ADAPTER_TRITON_URL"] == "triton:8001"


def test_the_model_volume() -> None:
    config = resolved()
    triton = config["services"]["triton"]
    assert mounts(triton) == {("models", "/models")}
    assert "models" in config["volumes"]
    assert triton["environment"]["MODEL_PATH"] == "/models"
    # A host folder instead, and a model inside it.
    triton = resolved(MODELS_DIR="/srv/models", MODEL_PATH="/models/qwen")["services"]["triton"]
    assert mounts(triton) == {("/srv/models", "/models")}
    assert triton["environment"]["MODEL_PATH"] == "/models/qwen"


@pytest.mark.parametrize("key", [None, "sk-from-the-environment"])
def test_the_api_key_comes_from_the_environment(key: str | None) -> None:
    env = {} if key is None else {"ADAPTER_API_KEY": key}
    environment = resolved(**env)["services"]["adapter"]["environment"]
    # Unset stays unset (null: not passed to the container), never a value written in the file.
    assert environment["ADAPTER_API_KEY"] == key
    assert "ADAPTER_API_KEY" not in (resolved()["services"]["triton"].get("environment") or {})
    assert "sk-" not in COMPOSE_FILE.read_text()


def test_only_the_adapter_is_public() -> None:
    services = resolved()["services"]
    assert port_bindings(services["triton"]) == {
        ("127.0.0.1", 8000, 8000),
        ("127.0.0.1", 8001, 8001),
        ("127.0.0.1", 8002, 8002),
    }
    assert port_bindings(services["adapter"]) == {("", 9000, 9000)}
    adapter = resolved(ADAPTER_PORT="8080")["services"]["adapter"]
    assert port_bindings(adapter) == {("", 8080, 9000)}
