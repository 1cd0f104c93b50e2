"""`make serve`: build the default model if needed, write the repository, run tritonserver and
the OpenAI adapter in front of it.

Waits until both are ready, logs where they listen, restarts either when it faults (a dead
engine process included; `backend.supervisor`), and on Ctrl-C / SIGTERM stops the adapter, then
tritonserver and its backend stubs; a second Ctrl-C kills them at once. They die with
the launcher even if it is killed (`backend.guardian`). `--model-path` serves any Hugging Face
causal-LM folder instead of the default model; `--tritonserver` runs a system binary (a Triton
container), not the bundled one; `--adapter-port 0` serves Triton alone.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from backend import adapter_server, default_model
from backend.adapter_server import AdapterServer
from backend.model_folder import check_model_folder
from backend.processes import ChildProcess, port_in_use
from backend.repository import known_parameters, write_repository
from backend.supervisor import RestartPolicy, Supervisor
from backend.tritonserver import TritonServer

logger = logging.getLogger("launcher")
RUN_DIR = default_model.REPO_ROOT / ".cache" / "run"


def port_number(value: str) -> int:
    """A TCP port, 0 included (a free one, or no adapter); an int beyond 65535 would wrap."""
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: 0-65535")
    return port


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add(
        "--model-path",
        type=Path,
        default=None,
        help="Hugging Face causal-LM folder (default: build the default model)",
    )
    add("--host", default="127.0.0.1", help="address tritonserver binds (default: loopback only)")
    add("--http-port", type=port_number, default=8000)
    add("--grpc-port", type=port_number, default=8001)
    add("--metrics-port", type=port_number, default=8002)
    add(
        "--tritonserver",
        type=Path,
        default=None,
        help="system tritonserver binary (default: the one in nvidia-pytriton)",
    )
    add("--backend-directory", type=Path, default=None)
    add(
        "--run-dir",
        type=Path,
        default=RUN_DIR,
        help="where the served model repository and the logs are written",
    )
    add(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"llm config parameter, one of {sorted(known_parameters() - {'model_path'})}",
    )
    add("--adapter-host", default="0.0.0.0", help="address the OpenAI adapter binds")
    add("--adapter-port", type=port_number, default=9000, help="0 = do not start the adapter")
    add(
        "--adapter-nice",
        type=int,
        default=adapter_server.NICE,
        help="the adapter's niceness: above 0 it yields the CPUs to the engine when they are "
        "short (0: the same priority)",
    )
    add(
        "--served-model-name",
        default=None,
        help="model id in the OpenAI API (default: the model folder's name)",
    )
    add(
        "--api-key",
        default=None,
        help="key the OpenAI adapter requires (`Authorization: Bearer <key>`); default: "
        "ADAPTER_API_KEY from the environment, else none. The variable keeps it out of the "
        "process list",
    )
    add(
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds tritonserver and the adapter have to become ready at start",
    )
    defaults = RestartPolicy()
    add(
        "--max-restarts",
        type=int,
        default=defaults.max_restarts,
        help="restarts of a faulty tritonserver or adapter allowed within --restart-window-s; "
        "one more fault and the launcher exits 1",
    )
    add("--restart-window-s", type=float, default=defaults.window_s)
    return parser.parse_args(argv)


def _parameters(pairs: list[str]) -> dict[str, str]:
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {pair!r}")
        values[key] = value
    return values


def check_ports(args: argparse.Namespace) -> None:
    """Fails at once where a port is taken: tritonserver would fail to bind it only after its
    models loaded, and meanwhile the other server's health URL answered for it, so the launcher
    announced a server that was not its own (a deploy audit)."""
    ports = [
        ("--http-port", args.host, args.http_port),
        ("--grpc-port", args.host, args.grpc_port),
        ("--metrics-port", args.host, args.metrics_port),
        ("--adapter-port", args.adapter_host, args.adapter_port),
    ]
    if ":" in args.host:  # tritonserver joins host and port with ":", which gRPC cannot parse
        raise SystemExit(f"--host {args.host}: tritonserver binds IPv4 addresses and names only")
    for flag, host, port in ports:
        try:
            taken = bool(port) and port_in_use(host, port)
        except OSError as exc:  # a host that does not resolve, or no address of this machine
            raise SystemExit(f"cannot serve: {flag} {port} on {host}: {exc}") from None
        if taken:
            raise SystemExit(f"cannot serve: {flag} {port} is in use on {host}")


def build_server(args: argparse.Namespace) -> TritonServer:
    parameters = _parameters(args.set)
    if "model_path" in parameters:
        raise SystemExit("--set model_path: give the model with --model-path")
    if args.tritonserver is not None and shutil.which(args.tritonserver) is None:  # PATH too
        raise SystemExit(f"--tritonserver {args.tritonserver}: no such executable")
    model_path = args.model_path or default_model.ensure()
    try:  # bad values fail here, in a second, rather than in the model's load
        check_model_folder(model_path)
        repository = write_repository(args.run_dir / "model_repository", model_path, parameters)
    except (ValueError, OSError) as exc:  # OSError: transformers' "cannot load the tokenizer"
        raise SystemExit(f"cannot serve {model_path}: {exc}") from None
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


def build_adapter(args: argparse.Namespace, server: TritonServer) -> AdapterServer | None:
    """The adapter, its settings (flags, and ADAPTER_* variables) checked before tritonserver
    starts: a bad one would stop it only once the model had loaded."""
    if not args.adapter_port:
        return None
    from pydantic import ValidationError

    from adapter.settings import AdapterSettings  # not in the Triton image, which serves no adapter

    try:
        AdapterSettings(host=args.adapter_host, port=args.adapter_port, triton_url=server.grpc_url)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in exc.errors()
        )
        message = f"cannot start the adapter (its flags or ADAPTER_* variables): {problems}"
        raise SystemExit(message) from None
    return AdapterServer(
        triton_url=server.grpc_url,
        host=args.adapter_host,
        port=args.adapter_port,
        served_model_name=args.served_model_name,
        log_path=args.run_dir / "adapter.log",
        api_key=args.api_key,
        nice=args.adapter_nice,
    )


def stop_signal_handler(
    stop: threading.Event, processes: Sequence[ChildProcess]
) -> Callable[[int, FrameType | None], None]:
    """SIGINT / SIGTERM: the first stops the children in order, the adapter after its drain;
    Ctrl-C (SIGINT) after it kills them all at once, open streams included, or before any
    started ends the launcher there. A SIGTERM after it changes nothing, as in uvicorn: `make`
    and `timeout` pass a SIGTERM to the group on to their child, which then gets two."""

    def handle(signum: int, frame: FrameType | None) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            if not processes:
                raise KeyboardInterrupt
            logger.warning("Ctrl-C again: killing %d processes now", len(processes))
            for process in processes:
                process.kill()
        stop.set()

    return handle


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    stop = threading.Event()
    processes: list[ChildProcess] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_signal_handler(stop, processes))
    started = time.monotonic()
    check_ports(args)
    try:
        server = build_server(args)  # building the default model takes a while
    except KeyboardInterrupt:
        return 130
    if stop.is_set():  # stopped meanwhile: start nothing only to stop it
        return 0
    adapter = build_adapter(args, server)

    def announce() -> None:
        logger.info(
            "ready in %.1f s: Triton HTTP %s, gRPC %s, metrics %s (logs in %s)",
            time.monotonic() - started,
            server.http_url,
            server.grpc_url,
            server.metrics_url,
            args.run_dir,
        )
        if adapter is not None:
            logger.info("OpenAI API: %s", adapter.base_url)

    processes += [server] if adapter is None else [server, adapter]
    policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window_s)
    try:
        return Supervisor(processes, stop, args.ready_timeout, policy).run(announce)
    except (RuntimeError, TimeoutError) as exc:  # a start that failed: its log tail says why
        logger.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
