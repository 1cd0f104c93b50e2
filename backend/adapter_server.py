"""The OpenAI adapter (`python -m adapter`) as a child process beside tritonserver."""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from backend.processes import ChildProcess, free_port

NICE = 10
"""The adapter's default niceness beside the engine (docs/design.md, "The adapter's CPU
priority")."""


class AdapterServer(ChildProcess):
    """uvicorn serving the adapter; ready when its /health/ready says Triton is ready too.

    `api_key` reaches the adapter as ADAPTER_API_KEY in its environment, not as a flag, so it
    does not show in the process list; `options` are other adapter flags (`max_n=2` becomes
    `--max-n 2`). It runs at niceness `nice`: on few CPUs, the engine's step comes first.
    """

    name = "adapter"
    # The adapter drains on it (in-flight requests finish up to --drain-timeout-s), as it does
    # when docker or Kubernetes stop it.
    stop_signal = signal.SIGTERM

    def __init__(
        self,
        triton_url: str,
        host: str = "127.0.0.1",
        port: int = 9000,
        served_model_name: str | None = None,
        log_path: Path | None = None,
        api_key: str | None = None,
        options: Mapping[str, object] | None = None,
        nice: int = NICE,
    ) -> None:
        super().__init__(log_path, nice)
        self.triton_url = triton_url
        self.host = host
        self.port = port or free_port()
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.options = dict(options or {})

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
        command = [
            sys.executable,
            "-m",
            "adapter",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--triton-url",
            self.triton_url,
        ]
        if self.served_model_name:
            command += ["--served-model-name", self.served_model_name]
        for name, value in self.options.items():
            command += [f"--{name.replace('_', '-')}", str(value)]
        return command

    @property
    def stop_timeout_s(self) -> float:
        """Its drain (`--drain-timeout-s`, from `options` or ADAPTER_DRAIN_TIMEOUT_S, as the
        adapter reads it) and uvicorn's 5 s shutdown after it, with 5 s to spare: it is killed
        only once its requests had their drain."""
        # Imported here: the Triton image runs the launcher without the adapter's package.
        from adapter.settings import AdapterSettings

        known = {k: v for k, v in self.options.items() if k in AdapterSettings.model_fields}
        return AdapterSettings.model_validate(known).drain_timeout_s + 10.0

    def env(self) -> dict[str, str]:
        env = super().env()
        if self.api_key is not None:
            env["ADAPTER_API_KEY"] = self.api_key
        return env
