"""deploy/: the kustomization renders, every resource validates against a current Kubernetes
schema (kubernetes-validate, strict: unknown fields fail), and the rendered stack is wired as
deploy/README.md describes (GPU requests, probes, headless Service, autoscaler on engine metrics).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from backend.supervisor import RestartPolicy
from tests.deploy.tools import DEPLOY_DIR, DOCKER_DIR, REPO_ROOT, run, tool

ENTRYPOINT = DOCKER_DIR / "triton-entrypoint.sh"

# The newest Kubernetes whose schemas kubernetes-validate 1.37 ships.
KUBERNETES_VERSION = "1.37.0"
NAMESPACE = "triton-logprobs"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    result = run([tool("kubectl"), "kustomize", str(DEPLOY_DIR)])
    assert result.returncode == 0, result.stderr
    path = tmp_path_factory.mktemp("kustomize") / "rendered.yaml"
    path.write_text(result.stdout)
    return path


@pytest.fixture(scope="module")
def resources(rendered: Path) -> dict[tuple[str, str], dict]:
    docs = [d for d in yaml.safe_load_all(rendered.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def validate(*paths: Path):
    return run(
        [
            tool("kubernetes-validate"),
            "--strict",
            "--kubernetes-version",
            KUBERNETES_VERSION,
            *map(str, paths),
        ]
    )


def kustomization_resources() -> list[Path]:
    kustomization = yaml.safe_load((DEPLOY_DIR / "kustomization.yaml").read_text())
    return [DEPLOY_DIR / name for name in kustomization["resources"]]


def test_the_rendered_stack_validates(rendered: Path, resources: dict) -> None:
    result = validate(rendered)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = [line for line in result.stdout.splitlines() if " passed for resource " in line]
    assert len(passed) == len(resources) == 10, result.stdout
    assert f"against version {KUBERNETES_VERSION.rsplit('.', 1)[0]}" in passed[0]


@pytest.mark.parametrize("path", kustomization_resources(), ids=lambda p: p.name)
def test_each_file_validates_on_its_own(path: Path) -> None:
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_manifest_in_deploy_is_in_the_kustomization() -> None:
    manifests = {p for p in DEPLOY_DIR.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert manifests == set(kustomization_resources())


def _misspelt_field(deployment: dict) -> None:
    deployment["spec"]["replica"] = 2


def _wrong_type(deployment: dict) -> None:
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"


@pytest.mark.parametrize(
    ("break_it", "reported"), [(_misspelt_field, "'replica'"), (_wrong_type, "containerPort")]
)
def test_the_validator_is_strict(tmp_path: Path, break_it, reported: str) -> None:
    """A misspelt field and a wrong type are errors, not warnings."""
    deployment = yaml.safe_load((DEPLOY_DIR / "adapter-deployment.yaml").read_text())
    break_it(deployment)
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(deployment))
    result = validate(broken)
    assert result.returncode != 0
    assert "did not validate" in result.stdout and reported in result.stdout


# --- the wiring ------------------------------------------------------------------------------


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def port_number(c: dict, name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name_or_number]
    return port


def test_everything_is_in_one_namespace(resources: dict) -> None:
    for (kind, name), doc in resources.items():
        if kind != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, (kind, name)


def test_selectors_match_their_pods(resources: dict) -> None:
    pods = {
        name: d["spec"]["template"]["metadata"]["labels"]
        for (kind, name), d in resources.items()
        if kind == "Deployment"
    }
    for deployment, labels in pods.items():
        selector = resources[("Deployment", deployment)]["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items()
    for (kind, name), doc in resources.items():
        if kind in ("Service", "PodDisruptionBudget"):
            selector = doc["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            matched = [d for d, labels in pods.items() if selector.items() <= labels.items()]
            assert len(matched) == 1, (kind, name, selector)


def test_triton_gets_a_gpu_and_the_launcher(resources: dict) -> None:
    triton = container(resources[("Deployment", "triton")])
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert triton["resources"]["requests"]["nvidia.com/gpu"] == 1
    # `args` keep the image's ENTRYPOINT; the command is the launcher's entrypoint script.
    assert triton["args"][0] == "triton-entrypoint" and "command" not in triton
    mounts = {m["mountPath"] for m in triton["volumeMounts"]}
    assert {"/models", "/dev/shm", "/tmp"} <= mounts


def test_triton_probes(resources: dict) -> None:
    triton = container(resources[("Deployment", "triton")])
    probes = {
        kind: (
            triton[kind]["httpGet"]["path"],
            port_number(triton, triton[kind]["httpGet"]["port"]),
        )
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert probes == {
        "startupProbe": ("/v2/health/ready", 8000),
        "readinessProbe": ("/v2/health/ready", 8000),
        "livenessProbe": ("/v2/health/live", 8000),
    }
    startup = triton["startupProbe"]
    # Room for building the default model and loading a large one before liveness applies, as
    # long as the entrypoint's launcher waits for it.
    [ready_timeout] = re.findall(r"READY_TIMEOUT_S:-(\d+)", ENTRYPOINT.read_text())
    assert startup["periodSeconds"] * startup["failureThreshold"] >= int(ready_timeout)
    # Room for the launcher to restart a faulty tritonserver (backend.supervisor: a backoff,
    # then a load of up to the ready timeout) before the kubelet restarts the container; the
    # readiness probe notices within 10 s.
    liveness, readiness = triton["livenessProbe"], triton["readinessProbe"]
    max_backoff = RestartPolicy().max_backoff_s
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= max_backoff + int(
        ready_timeout
    )
    assert readiness["periodSeconds"] * readiness["failureThreshold"] <= 10


def test_the_headless_service_lists_ready_triton_pods(resources: dict) -> None:
    headless = resources[("Service", "triton-headless")]["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["publishNotReadyAddresses"] is False
    (grpc,) = headless["ports"]
    triton = container(resources[("Deployment", "triton")])
    assert grpc["port"] == 8001 and port_number(triton, grpc["targetPort"]) == 8001


def test_the_adapter_spreads_over_the_headless_service(resources: dict) -> None:
    adapter = container(resources[("Deployment", "adapter")])
    env = {e["name"]: e for e in adapter["env"]}
    assert env["ADAPTER_TRITON_URL"]["value"] == "triton-headless:8001"
    secret = env["ADAPTER_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert secret == {"name": "adapter-api-key", "key": "api-key"}
    probes = {
        kind: (
            adapter[kind]["httpGet"]["path"],
            port_number(adapter, adapter[kind]["httpGet"]["port"]),
        )
        for kind in ("readinessProbe", "livenessProbe")
    }
    assert probes == {"readinessProbe": ("/health/ready", 9000), "livenessProbe": ("/health", 9000)}
    assert "nvidia.com/gpu" not in str(adapter["resources"])
    assert resources[("HorizontalPodAutoscaler", "adapter")]["spec"]["minReplicas"] >= 2


def test_the_autoscalers_own_the_replica_counts(resources: dict) -> None:
    for name in ("triton", "adapter"):
        assert "replicas" not in resources[("Deployment", name)]["spec"]
        target = resources[("HorizontalPodAutoscaler", name)]["spec"]["scaleTargetRef"]
        assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}


def test_triton_scales_on_the_engines_queue_and_sequences(resources: dict) -> None:
    hpa = resources[("HorizontalPodAutoscaler", "triton")]["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "triton",
    }
    metrics = {
        m["pods"]["metric"]["name"]: m["pods"] for m in hpa["metrics"] if m["type"] == "Pods"
    }
    assert set(metrics) == {"llm_waiting_requests", "llm_active_sequences"}
    # The names the llm model registers on Triton's metrics port.
    model_py = (REPO_ROOT / "model_repository" / "llm" / "1" / "model.py").read_text()
    for name, metric in metrics.items():
        assert f'"{name}"' in model_py
        assert metric["metric"]["selector"] == {"matchLabels": {"model": "llm"}}
        assert metric["target"]["type"] == "AverageValue"
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]


def test_no_service_becomes_a_setting(resources: dict) -> None:
    """With service links on, the kubelet gives every pod `<SERVICE>_PORT=tcp://<ip>:<port>` and
    more for each Service in the namespace: for the Service `adapter` that is ADAPTER_PORT,
    which the adapter reads as its port (`ADAPTER_` settings) and refuses, crash-looping (an
    audit). The pods turn the links off."""
    from adapter.settings import AdapterSettings

    prefix = AdapterSettings.model_config["env_prefix"]
    services = [name for kind, name in resources if kind == "Service"]
    assert any(name.upper().replace("-", "_") + "_" == prefix for name in services)
    for kind, name in resources:
        if kind == "Deployment":
            spec = resources[(kind, name)]["spec"]["template"]["spec"]
            assert spec.get("enableServiceLinks") is False, name


def test_the_adapter_has_its_drain_before_it_is_killed(resources: dict) -> None:
    """After the preStop sleep the adapter drains its streams for `drain_timeout_s`, then
    uvicorn shuts down: the grace period leaves it that and the launcher's 10 s margin, or the
    kubelet kills streams before their error event and [DONE] (an audit)."""
    from adapter.settings import AdapterSettings

    spec = resources[("Deployment", "adapter")]["spec"]["template"]["spec"]
    pre_stop = container(resources[("Deployment", "adapter")])["lifecycle"]["preStop"]
    drain = AdapterSettings.model_fields["drain_timeout_s"].default
    grace = spec["terminationGracePeriodSeconds"]
    assert grace >= pre_stop["sleep"]["seconds"] + drain + 10
