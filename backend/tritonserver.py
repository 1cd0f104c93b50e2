"""Run tritonserver: the one bundled in nvidia-pytriton, or a system one (a Triton container).

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
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import psutil

from backend.config import RESTARTS_ENV
from backend.processes import ChildProcess, free_ports

logger = logging.getLogger(__name__)
STUB_BINARY = "triton_python_backend_stub"
SHM_REGION_PREFIX = "triton_python_backend_shm_region_"
SHM_DIR = Path("/dev/shm")


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


@dataclass(frozen=True)
class BackendStub:
    """One Python-backend stub process: a model instance, and the shared memory it talks over."""

    process: psutil.Process
    model: str
    shm_region: str | None

    @classmethod
    def of(cls, process: psutil.Process) -> BackendStub | None:
        """The stub `process` is, or None for another process (or one gone meanwhile)."""
        try:
            args = process.cmdline()
        except psutil.Error:
            return None
        if not args or Path(args[0]).name != STUB_BINARY or len(args) < 2:
            return None
        # Its arguments: the model file (<repository>/<model>/<version>/model.py), the region...
        region = next((arg for arg in args if arg.startswith(SHM_REGION_PREFIX)), None)
        return cls(process, Path(args[1]).parent.parent.name, region)

    @property
    def alive(self) -> bool:
        return running(self.process)


def running(process: psutil.Process) -> bool:
    """Still running: the same process (psutil compares start times), and not a zombie."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def backend_stubs(server_pid: int) -> list[BackendStub]:
    """The Python-backend stubs tritonserver `server_pid` runs."""
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.Error:
        return []
    return [stub for stub in map(BackendStub.of, children) if stub is not None]


def remove_shm_regions(regions: set[str]) -> None:
    """Unlinks the stubs' `regions` from /dev/shm (a killed tritonserver leaves them behind)."""
    for region in sorted(regions):
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / region).unlink()
            logger.info("removed %s left by the stopped server", region)


class TritonServer(ChildProcess):
    """tritonserver on `model_repository`; ports of 0 are replaced by free ones.

    `tritonserver` is a system binary (a container's /opt/tritonserver/bin/tritonserver); None
    uses the bundled one. A context manager: ready on entry, stopped (stubs included) on exit.

    Once ready it knows its backend stubs: one that dies is a `fault` (python_backend neither
    restarts it nor fails its requests, and the model stays "ready"; docs/design.md, "Surviving
    the engine's death"), and their shared-memory regions, which a killed server leaves behind,
    are removed when it stops.
    """

    name = "tritonserver"

    def __init__(
        self,
        model_repository: Path,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        host: str = "127.0.0.1",
        tritonserver: Path | None = None,
        backend_directory: Path | None = None,
        log_path: Path | None = None,
    ) -> None:
        super().__init__(log_path)
        self.model_repository = model_repository
        spare = iter(free_ports([http_port, grpc_port, metrics_port].count(0)))
        self.http_port = http_port or next(spare)
        self.grpc_port = grpc_port or next(spare)
        self.metrics_port = metrics_port or next(spare)
        self.host = host
        self.tritonserver = tritonserver
        self.backend_directory = backend_directory
        self.stubs: list[BackendStub] = []
        self.shm_regions: set[str] = set()
        """The regions of every stub seen since the start, also of a start that failed."""

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def ready_url(self) -> str:
        return f"{self.http_url}/v2/health/ready"

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
        return command

    def is_ready(self) -> bool:
        """Ready, noting the stubs started so far: a server that fails after loading its models
        (a port taken) leaves their regions in /dev/shm, which in a pod outlive the container."""
        if self.pid is not None:
            self._note_regions(backend_stubs(self.pid))
        return super().is_ready()

    def _note_regions(self, stubs: list[BackendStub]) -> None:
        self.shm_regions.update(stub.shm_region for stub in stubs if stub.shm_region)

    def became_ready(self) -> None:
        """Every model is loaded, so every stub runs: remember them."""
        assert self.pid is not None
        self.stubs = backend_stubs(self.pid)
        self._note_regions(self.stubs)
        logger.info(
            "backend stubs: %s",
            ", ".join(f"{stub.model} (pid {stub.process.pid})" for stub in self.stubs),
        )

    def fault(self) -> str | None:
        for stub in self.stubs:
            if not stub.alive:
                return f"the backend stub of `{stub.model}` (pid {stub.process.pid}) died"
        return super().fault()

    def stopped(self) -> None:
        """Removes the stubs' shared-memory regions that a killed server could not."""
        remove_shm_regions(self.shm_regions)
        self.stubs = []
        self.shm_regions = set()

    def env(self) -> dict[str, str]:
        env = super().env()
        env[RESTARTS_ENV] = str(self.restarts)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        if self._bundled():  # a system server keeps its image's library path (CUDA compat libs)
            import pytriton

            libs = [
                sysconfig.get_config_var("LIBDIR") or "",
                str(Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"),
            ]
            env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")])
        return env

    def _bundled(self) -> bool:
        """Whether the binary is nvidia-pytriton's (also when passed as `tritonserver`)."""
        if self.tritonserver is None:
            return True
        try:
            import pytriton
        except ImportError:
            return False
        return Path(pytriton.__file__).parent in Path(self.tritonserver).resolve().parents
