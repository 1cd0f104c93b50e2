"""Run tritonserver: the one bundled in nvidia-pytriton, or a system one (a Triton container).

The bundled server (Triton 2.51) needs three things to run Python-backend models from this venv:
the backend stub for the running Python in `backends/python/`, this venv's `bin` first on PATH
(the stub finds its interpreter as the first `python3` there, ignoring PYTHONPATH), and this
Python's own libpython first on LD_LIBRARY_PATH (or the stub may load another patch level).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

from backend.processes import ChildProcess, free_port


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


class TritonServer(ChildProcess):
    """tritonserver on `model_repository`; ports of 0 are replaced by free ones.

    `tritonserver` is a system binary (a container's /opt/tritonserver/bin/tritonserver); None
    uses the bundled one. A context manager: ready on entry, stopped (stubs included) on exit.
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
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.host = host
        self.tritonserver = tritonserver
        self.backend_directory = backend_directory

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

    def env(self) -> dict[str, str]:
        env = super().env()
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
