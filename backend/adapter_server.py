"""The OpenAI adapter (`python -m adapter`) as a child process beside tritonserver."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from backend.processes import ChildProcess, free_port


class AdapterServer(ChildProcess):
    """uvicorn serving the adapter; ready when its /health/ready says Triton is ready too."""

    name = "adapter"
    stop_signal = signal.SIGINT  # uvicorn's graceful shutdown

    def __init__(
        self,
        triton_url: str,
        host: str = "127.0.0.1",
        port: int = 9000,
        served_model_name: str | None = None,
        log_path: Path | None = None,
    ) -> None:
        super().__init__(log_path)
        self.triton_url = triton_url
        self.host = host
        self.port = port or free_port()
        self.served_model_name = served_model_name

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What OpenAI clients take as `base_url`."""
        return f"{self.url}/v1"

    @property
    def ready_url(self) -> str:
        return f"{self.url}/health/ready"

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "adapter", "--host", self.host, "--port", str(self.port),
                   "--triton-url", self.triton_url]  # fmt: skip
        if self.served_model_name:
            command += ["--served-model-name", self.served_model_name]
        return command
