"""Start, wait for and stop tritonserver: the one bundled in nvidia-pytriton, or a system one.

The bundled server (Triton 2.51) needs three things to run Python-backend models from this venv:
the backend stub for the running Python in `backends/python/`, this venv's `bin` first on PATH
(the stub finds its interpreter as the first `python3` there, ignoring PYTHONPATH), and this
Python's own libpython first on LD_LIBRARY_PATH (or the stub may load another patch level).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def embedded_tritonserver() -> tuple[Path, Path]:
    """(binary, backends folder) of nvidia-pytriton's server, with this Python's stub in place."""
    import pytriton

    root = Path(pytriton.__file__).parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    target = root / "backends" / "python" / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    if not target.exists() or target.read_bytes() != stub.read_bytes():
        shutil.copy2(stub, target)
    return root / "bin" / "tritonserver", root / "backends"


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    libs = [sysconfig.get_config_var("LIBDIR") or ""]
    try:
        import pytriton

        libs.append(str(Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"))
    except ImportError:
        pass
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")])
    return env


@dataclass
class TritonServer:
    """A tritonserver child process; a context manager that waits for readiness and cleans up.

    Ports of 0 are replaced by free ones. `tritonserver` is a system binary (a container's
    /opt/tritonserver/bin/tritonserver); None uses the bundled one.
    """

    model_repository: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "127.0.0.1"
    tritonserver: Path | None = None
    backend_directory: Path | None = None
    log_path: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    _process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _log_file: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.http_port = self.http_port or free_port()
        self.grpc_port = self.grpc_port or free_port()
        self.metrics_port = self.metrics_port or free_port()

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        binary, backends = self.tritonserver, self.backend_directory
        if binary is None:
            binary, embedded_backends = embedded_tritonserver()
            backends = backends or embedded_backends
        command = [
            str(binary),
            f"--model-repository={self.model_repository}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            "--exit-timeout-secs=10",
        ]
        if backends is not None:
            command.append(f"--backend-directory={backends}")
        return command + self.extra_args

    def start(self) -> None:
        output = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = output = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        logger.info("starting %s", " ".join(self.command()))
        # Its own session, so stop() can also reach the backend stubs it forked.
        self._process = subprocess.Popen(
            self.command(),
            env=_server_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with {self._process.returncode}\n" + self.log_tail()
                )
            if self.is_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f} s\n" + self.log_tail())

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (tritonserver unloads models and stops the stubs), then kill what is left."""
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("tritonserver did not stop in %.0f s; killing it", timeout_s)
            with contextlib.suppress(ProcessLookupError):  # the stubs, if any outlived it
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
