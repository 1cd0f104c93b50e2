"""`make serve`: build the default model if needed, write the repository, run tritonserver.

Waits until Triton is ready, logs where it listens, and on Ctrl-C / SIGTERM stops tritonserver
and its backend stubs. `--model-path` serves any Hugging Face causal-LM folder instead of the
default model; `--tritonserver` runs a system binary (a Triton container), not the bundled one.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from backend import default_model
from backend.repository import known_parameters, write_repository
from backend.tritonserver import TritonServer

logger = logging.getLogger("launcher")
RUN_DIR = default_model.REPO_ROOT / ".cache" / "run"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model-path",
        type=Path,
        default=None,
        help="Hugging Face causal-LM folder (default: build the default model)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address tritonserver binds (default: loopback only)"
    )
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument(
        "--tritonserver",
        type=Path,
        default=None,
        help="system tritonserver binary (default: the one in nvidia-pytriton)",
    )
    parser.add_argument("--backend-directory", type=Path, default=None)
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=RUN_DIR,
        help="where the served model repository and logs are written",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"llm config parameter, one of {sorted(known_parameters())}",
    )
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    return parser.parse_args(argv)


def _parameters(pairs: list[str]) -> dict[str, str]:
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {pair!r}")
        values[key] = value
    return values


def build_server(args: argparse.Namespace) -> TritonServer:
    model_path = args.model_path or default_model.ensure()
    repository = write_repository(
        args.run_dir / "model_repository", model_path, _parameters(args.set)
    )
    return TritonServer(
        model_repository=repository,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        host=args.host,
        tritonserver=args.tritonserver,
        backend_directory=args.backend_directory,
        log_path=args.run_dir / "tritonserver.log",
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    server = build_server(args)
    server.start()
    try:
        server.wait_ready(args.ready_timeout)
        logger.info(
            "ready in %.1f s: HTTP %s, gRPC %s, metrics %s (log: %s)",
            time.monotonic() - started,
            server.http_url,
            server.grpc_url,
            server.metrics_url,
            server.log_path,
        )
        while not stop.wait(1.0):
            if server._process is None or server._process.poll() is not None:
                logger.error("tritonserver exited\n%s", server.log_tail())
                return 1
    finally:
        logger.info("stopping tritonserver")
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
