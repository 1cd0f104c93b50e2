"""The adapter as a child process (`python -m adapter`), for integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from backend.tritonserver import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class AdapterServer:
    """Starts uvicorn on a free port, waits for /health/ready, stops it; a context manager."""

    triton_url: str
    log_path: Path
    served_model_name: str = "test-model"
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    _process: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What OpenAI clients take as `base_url`."""
        return f"{self.url}/v1"

    def start(self) -> None:
        command = [
            sys.executable, "-m", "adapter",
            "--host", self.host,
            "--port", str(self.port),
            "--triton-url", self.triton_url,
            "--served-model-name", self.served_model_name,
        ]  # fmt: skip
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(
                    f"the adapter exited with {self._process.returncode}\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the adapter is not ready after {timeout_s:.0f} s\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> AdapterServer:
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
