"""The launcher as a deployment runs it: `python -m backend.launcher` with an explicit
tritonserver binary (the bundled one standing in for a container's /opt/tritonserver), and the
Triton container's command, docker/triton-entrypoint.sh, which execs the launcher.

Each test starts the real processes on free loopback ports, makes real requests (a tritonclient
gRPC stream to `llm`, and `/v1/completions` through the adapter), sends SIGTERM as `docker stop`
or a pod deletion does, and then checks that the launcher exited with 0 and that none of the
processes it started (tritonserver, its Python-backend stubs, the adapter) is left.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from backend import contract
from backend.default_model import DEFAULT_SPEC, REPO_ROOT, SPEC_FILE
from backend.processes import free_ports
from backend.tritonserver import SHM_DIR, backend_stubs, embedded_tritonserver
from tests.integration.openai_support import wait_for
from tests.integration.proc import descendants, processes_mentioning, still_running
from tests.reference import reference_greedy, tokenizer
from tests.streaming import generate

ENTRYPOINT = REPO_ROOT / "docker" / "triton-entrypoint.sh"
PROMPT = "Triton serves the model"  # the start of the passage the test model learnt
MAX_TOKENS = 8
READY_TIMEOUT_S = 240.0  # the entrypoint test builds the default model first (~40 s here)
STOP_TIMEOUT_S = 60.0  # the adapter, then tritonserver (--exit-timeout-secs=10) and its stubs
# Small limits for the 2-core test machine, as in tests/conftest.py.
PARAMETERS = ["--set", "max_model_len=256", "--set", "max_num_seqs=4"]


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int
    adapter: int

    @classmethod
    def free(cls) -> Ports:
        return cls(*free_ports(4))

    def triton_flags(self) -> list[str]:
        return [
            "--http-port",
            str(self.http),
            "--grpc-port",
            str(self.grpc),
            "--metrics-port",
            str(self.metrics),
        ]


def unbindable(ports: Ports) -> list[int]:
    """Those of `ports` a server could not bind now (one past TIME_WAIT may: SO_REUSEADDR)."""
    taken = []
    for port in (ports.http, ports.grpc, ports.metrics, ports.adapter):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    return taken


def sockets_on(ports: list[int]) -> list[str]:
    """The /proc/net/tcp rows with one of `ports` at either end, to say what holds them."""
    wanted = {f":{port:04X}" for port in ports}
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return [row for row in rows if any(end[-5:] in wanted for end in row.split()[1:3])]


# --- one launched process tree ---------------------------------------------------------------


@dataclass
class Launched:
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.log():
                return
            if self.process.poll() is not None:
                pytest.fail(f"exited with {self.process.returncode} before {text!r}:\n{self.log()}")
            time.sleep(0.25)
        pytest.fail(f"no {text!r} after {timeout_s:.0f} s:\n{self.log()[-4000:]}")

    def stop(self) -> int:
        """SIGTERM, as `docker stop` and a pod deletion send; the exit code within the bound."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"still running {STOP_TIMEOUT_S:.0f} s after SIGTERM:\n{self.log()[-4000:]}"
            )


@contextlib.contextmanager
def launched(
    command: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[Launched]:
    """Run `command` in its own session; whatever happens, nothing of it outlives the test."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=REPO_ROOT,
            env=env,
        )
    seen: dict[int, str] = {}
    try:
        yield Launched(process, log_path)
    finally:
        if process.poll() is None:
            seen.update(descendants(process.pid))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        # The launcher starts its children in their own sessions: end those groups too.
        for pid in still_running(seen):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def assert_stops_cleanly(server: Launched, run_dir: Path, expected: tuple[str, ...]) -> None:
    """SIGTERM: exit 0 within the bound, no started process left (by pid and by run dir)."""
    children = descendants(server.process.pid)
    for name in expected:
        assert any(name in cmd for cmd in children.values()), (name, children)
    assert server.stop() == 0, server.log()[-4000:]
    assert still_running(children) == {}
    # tritonserver's and every stub's command line names the served repository under run_dir.
    assert processes_mentioning(str(run_dir)) == {}


# --- requests --------------------------------------------------------------------------------


def greedy_stream(grpc_url: str, model_dir: Path) -> tuple[list[int], str]:
    """Token ids and text of a greedy `llm` stream; the ids equal transformers' `generate`."""
    prompt_ids = tokenizer(model_dir)(PROMPT)["input_ids"]
    result = generate(
        grpc_url,
        "llm",
        {
            contract.INPUT_IDS: np.array(prompt_ids, dtype=np.int32),
            contract.MAX_TOKENS: np.array([MAX_TOKENS], dtype=np.int32),
            contract.TEMPERATURE: np.array([0.0], dtype=np.float32),
        },
    )
    assert result.error is None, result.error
    assert result.token_ids == reference_greedy(model_dir, prompt_ids, MAX_TOKENS)
    assert result.finish_reason == "length"
    return result.token_ids, result.text


def assert_ready(url: str) -> None:
    reply = httpx.get(url, timeout=5)
    assert reply.status_code == 200, (url, reply.status_code, reply.text)


@pytest.fixture
def embedded() -> tuple[Path, Path]:
    """(binary, backends folder) of the bundled tritonserver: the stand-in for a system one."""
    binary, backends = embedded_tritonserver()
    assert binary.is_file() and (backends / "python").is_dir()
    return binary, backends


# --- the tests -------------------------------------------------------------------------------


@pytest.mark.timeout(420)
def test_launcher_serves_with_a_system_tritonserver_and_stops_on_sigterm(
    model_dir: Path, embedded: tuple[Path, Path], tmp_path: Path
) -> None:
    binary, backends = embedded
    ports = Ports.free()
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "backend.launcher",
        "--model-path",
        str(model_dir),
        "--host",
        "127.0.0.1",
        *ports.triton_flags(),
        "--tritonserver",
        str(binary),
        "--backend-directory",
        str(backends),
        "--run-dir",
        str(run_dir),
        "--adapter-host",
        "127.0.0.1",
        "--adapter-port",
        str(ports.adapter),
        "--served-model-name",
        "launcher-model",
        *PARAMETERS,
    ]
    with launched(command, tmp_path / "launcher.log") as server:
        server.wait_for_log("OpenAI API: ")
        assert f"OpenAI API: http://127.0.0.1:{ports.adapter}/v1" in server.log()
        assert_ready(f"http://127.0.0.1:{ports.http}/v2/health/ready")
        assert_ready(f"http://127.0.0.1:{ports.adapter}/health/ready")
        # The launcher wrote the served repository and both logs under --run-dir.
        llm_config = (run_dir / "model_repository" / "llm" / "config.pbtxt").read_text()
        assert f'string_value: "{model_dir.resolve()}"' in llm_config
        assert (run_dir / "tritonserver.log").is_file() and (run_dir / "adapter.log").is_file()

        _, text = greedy_stream(f"127.0.0.1:{ports.grpc}", model_dir)
        reply = httpx.post(
            f"http://127.0.0.1:{ports.adapter}/v1/completions",
            json={
                "model": "launcher-model",
                "prompt": PROMPT,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            },
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == "launcher-model"
        assert body["choices"][0]["text"] == text
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        # The engine metrics the Kubernetes autoscaler reads (deploy/triton-hpa.yaml).
        metrics = httpx.get(f"http://127.0.0.1:{ports.metrics}/metrics", timeout=5).text
        for name in ("llm_waiting_requests", "llm_active_sequences"):
            assert re.search(rf'^{name}{{[^}}]*model="llm"', metrics, re.MULTILINE), name

        assert_stops_cleanly(
            server, run_dir, expected=("tritonserver", "triton_python_backend_stub", "-m adapter")
        )
        assert "stopping adapter" in server.log() and "stopping tritonserver" in server.log()


@pytest.mark.timeout(480)
def test_container_entrypoint_builds_the_default_model_into_an_empty_volume(
    embedded: tuple[Path, Path], tmp_path: Path
) -> None:
    """docker/triton-entrypoint.sh with an empty model volume, as the container starts it."""
    binary, backends = embedded
    assert os.access(ENTRYPOINT, os.X_OK), "the image runs the script itself: keep its exec bit"
    ports = Ports.free()
    volume, run_dir = tmp_path / "models", tmp_path / "run"
    volume.mkdir()
    env = {
        **os.environ,
        # The image's python3 is the one with the project; here it is this environment's.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "MODEL_PATH": str(volume),
        "RUN_DIR": str(run_dir),
        "TRITONSERVER": str(binary),
        "TRITON_BACKEND_DIRECTORY": str(backends),
        "TRITON_HOST": "127.0.0.1",  # the image binds 0.0.0.0; a test stays on loopback
    }
    # Extra arguments are launcher flags, as in compose's or Kubernetes' command.
    command = [str(ENTRYPOINT), *ports.triton_flags(), *PARAMETERS]
    with launched(command, tmp_path / "entrypoint.log", env) as server:
        server.wait_for_log("ready in ")
        built = volume / DEFAULT_SPEC.name
        assert (built / "config.json").is_file() and (built / SPEC_FILE).is_file()
        # exec: the process the container runtime signals is the launcher itself, not bash.
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().split(b"\0")
        assert b"backend.launcher" in cmdline, cmdline
        assert (
            f'string_value: "{built.resolve()}"'
            in (run_dir / "model_repository" / "llm" / "config.pbtxt").read_text()
        )
        assert_ready(f"http://127.0.0.1:{ports.http}/v2/health/ready")
        assert "OpenAI API" not in server.log()  # Triton alone: the adapter is its own container

        ids, _ = greedy_stream(f"127.0.0.1:{ports.grpc}", built)
        assert len(ids) == MAX_TOKENS

        children = descendants(server.process.pid)
        assert not any("-m adapter" in cmd for cmd in children.values()), children
        assert_stops_cleanly(
            server, run_dir, expected=("tritonserver", "triton_python_backend_stub")
        )


def test_container_entrypoint_refuses_a_model_path_that_does_not_exist(tmp_path: Path) -> None:
    """A typo in MODEL_PATH, or a volume not mounted: an error at once, and nothing written
    there (the default model used to be built into the mistyped folder and served)."""
    missing = tmp_path / "models" / "Qwen2.5-0.5B-lnstruct"
    env = {**os.environ, "MODEL_PATH": str(missing), "TRITONSERVER": "/nonexistent"}
    result = subprocess.run(
        [str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert f"MODEL_PATH {missing} does not exist: mount a model folder there" in result.stderr
    assert not (tmp_path / "models").exists()


@pytest.mark.timeout(420)
def test_children_die_with_a_killed_launcher(model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM, then SIGKILL during the shutdown, as an impatient supervisor does: tritonserver,
    its stubs and the adapter go too (`backend.guardian`), their ports are free again, and the
    stubs' shared-memory regions are gone."""
    ports = Ports.free()
    run_dir = tmp_path / "run"
    command = [
        *(sys.executable, "-m", "backend.launcher", "--model-path", str(model_dir)),
        *("--host", "127.0.0.1", *ports.triton_flags(), "--run-dir", str(run_dir)),
        *("--adapter-host", "127.0.0.1", "--adapter-port", str(ports.adapter), *PARAMETERS),
    ]
    with launched(command, tmp_path / "launcher.log") as server:
        server.wait_for_log("OpenAI API: ")
        children = descendants(server.process.pid)
        for name in ("tritonserver", "triton_python_backend_stub", "-m adapter", "guardian"):
            assert any(name in cmd for cmd in children.values()), (name, children)
        regions = [
            stub.shm_region
            for pid, cmd in children.items()
            if "triton_python_backend_stub" not in cmd and "tritonserver" in cmd
            for stub in backend_stubs(pid)
        ]
        assert len(regions) == 2 and all(regions), regions  # `llm` and `preprocessing`
        server.process.send_signal(signal.SIGTERM)
        server.process.kill()
        server.process.wait()
        assert wait_for(lambda: still_running(children) == {}), still_running(children)
        assert processes_mentioning(str(run_dir)) == {}
        # The kernel closes a killed process's sockets as its last thread exits, which may be
        # after its main thread is reaped: a condition to wait for, not a moment to sample.
        assert wait_for(lambda: unbindable(ports) == []), sockets_on(unbindable(ports))
        assert wait_for(lambda: not [r for r in regions if (SHM_DIR / r).exists()]), regions


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ("max_num_seqs=abc", "config.pbtxt parameter `max_num_seqs` must be an integer"),
        ("max_queue_size=0", "max_queue_size must be >= 1, got 0"),
        ("model_path=/elsewhere", "--set model_path: give the model with --model-path"),
    ],
)
def test_bad_set_values_stop_the_launcher_before_tritonserver(
    model_dir: Path, tmp_path: Path, pair: str, message: str
) -> None:
    """Checked while the repository is written, in a second, with the key named."""
    from backend import launcher

    args = launcher.parse_args(
        ["--model-path", str(model_dir), "--run-dir", str(tmp_path), "--set", pair]
    )
    with pytest.raises(SystemExit, match=re.escape(message)):
        launcher.build_server(args)
    assert not (tmp_path / "tritonserver.log").exists()


def test_a_failed_start_is_logged_without_a_traceback(
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """tritonserver exiting at start (a model that does not load): its log tail, exit 1."""
    from backend import launcher

    class FailingSupervisor:
        def __init__(self, *args: object) -> None:
            pass

        def run(self, on_ready: object) -> int:
            raise RuntimeError("tritonserver exited with 1\nllm: BloomForCausalLM is not supported")

    monkeypatch.setattr(launcher, "Supervisor", FailingSupervisor)
    argv = ["--model-path", str(model_dir), "--run-dir", str(tmp_path), "--adapter-port", "0"]
    assert launcher.main(argv) == 1
    assert "BloomForCausalLM is not supported" in caplog.text
