"""A child started with a niceness runs at it, threads it starts later included, and so does its
session's scheduling group where the kernel has one (docs/design.md, "The adapter's CPU
priority")."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
from pathlib import Path

import pytest

from backend.adapter_server import AdapterServer
from backend.launcher import (
    build_adapter,
    build_server,
    check_ports,
    parse_args,
    stop_signal_handler,
)
from backend.launcher import main as launcher_main
from backend.processes import ChildProcess, free_port, free_ports, port_in_use
from tests.integration.openai_support import wait_for

# Prints the niceness of a thread it starts, then its session group's line (if any).
_REPORT = """
import os, pathlib, threading
seen = []
thread = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)))
thread.start()
thread.join()
print(seen[0])
group = pathlib.Path("/proc/self/autogroup")
print(group.read_text().strip() if group.exists() else "no autogroup")
"""


class Reporter(ChildProcess):
    def command(self) -> list[str]:
        return [sys.executable, "-c", _REPORT]


def test_a_child_runs_at_its_niceness_and_so_does_its_session_group(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = Reporter(log, nice=7)
    child.start()
    assert wait_for(lambda: not child.running)
    child.stop()
    thread_nice, group = log.read_text().splitlines()
    assert int(thread_nice) == 7
    assert group == "no autogroup" or group.endswith(" nice 7")


def test_the_launcher_starts_the_adapter_below_the_engines_priority() -> None:
    triton = type("Triton", (), {"grpc_url": "127.0.0.1:1"})()
    default = build_adapter(parse_args([]), triton)  # type: ignore[arg-type]
    same = build_adapter(parse_args(["--adapter-nice", "0"]), triton)  # type: ignore[arg-type]
    assert default is not None and default.nice == 10
    assert same is not None and same.nice == 0


def test_the_adapter_is_killed_only_after_its_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopping the adapter waits for its drain (`--drain-timeout-s`, as the adapter reads it)
    and uvicorn's shutdown after it, not a fixed 30 s that cut a longer drain's streams."""
    triton = type("Triton", (), {"grpc_url": "127.0.0.1:1"})()
    monkeypatch.delenv("ADAPTER_DRAIN_TIMEOUT_S", raising=False)
    adapter = build_adapter(parse_args([]), triton)  # type: ignore[arg-type]
    assert adapter is not None and adapter.stop_timeout_s == 20.0 + 10.0
    monkeypatch.setenv("ADAPTER_DRAIN_TIMEOUT_S", "40")
    assert adapter.stop_timeout_s == 40.0 + 10.0
    assert AdapterServer("127.0.0.1:1", options={"drain_timeout_s": 3}).stop_timeout_s == 13.0
    assert Reporter().stop_timeout_s == 30.0


def test_free_ports_are_distinct_bindable_by_a_server_and_held_from_everyone_else() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16 and all(port > 0 for port in ports)
    for port in ports:
        with socket.socket() as plain, pytest.raises(OSError):  # an ordinary bind is refused
            plain.bind(("127.0.0.1", port))
    with contextlib.ExitStack() as sockets:  # no ephemeral port is one of them
        drawn = [sockets.enter_context(socket.socket()) for _ in range(500)]
        for sock in drawn:
            sock.bind(("127.0.0.1", 0))
        assert not {sock.getsockname()[1] for sock in drawn} & set(ports)
    with socket.socket() as server:  # a server binds it as tritonserver and uvicorn do
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", ports[0]))
        server.listen(1)


class ExitsAtOnce(ChildProcess):
    """Exits with 3 before its (unserved) ready URL ever answers."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "raise SystemExit(3)"]

    @property
    def ready_url(self) -> str:
        return f"http://127.0.0.1:{free_port()}/ready"


def test_start_ready_stops_a_child_that_never_became_ready(tmp_path: Path) -> None:
    child = ExitsAtOnce(tmp_path / "child.log")
    with pytest.raises(RuntimeError, match="exited with 3"):
        child.start_ready()
    assert child.pid is None and not child.running


class IgnoresStop(ChildProcess):
    """Outlives SIGTERM, as a server draining long streams would; notes each one it gets."""

    stop_timeout_s = 120.0  # a hang guard: a kill ends the wait in milliseconds

    def __init__(self, folder: Path) -> None:
        super().__init__()
        folder.mkdir()
        self.ready, self.signalled = folder / "ready", folder / "signalled"

    def command(self) -> list[str]:
        script = f"trap 'touch {self.signalled}' TERM; touch {self.ready}; "
        return ["sh", "-c", script + "while :; do sleep 600 & wait; done"]

    def is_ready(self) -> bool:
        return self.ready.exists()


def test_ctrl_c_after_a_stop_signal_kills_the_children_at_once(tmp_path: Path) -> None:
    """The first signal stops the children in order (here: `stop` waits for a child that
    outlives SIGTERM); a second SIGTERM changes nothing (`make` passes a group's SIGTERM on
    to its child); Ctrl-C then kills every child, and the main thread's wait ends."""
    children = [IgnoresStop(tmp_path / "a"), IgnoresStop(tmp_path / "b")]
    stop = threading.Event()
    handle = stop_signal_handler(stop, children)
    previous = signal.signal(signal.SIGINT, handle)
    try:
        for child in children:
            child.start_ready()
        handle(signal.SIGTERM, None)
        handle(signal.SIGTERM, None)
        assert stop.is_set() and all(child.running for child in children)

        def ctrl_c_once_stopping() -> None:
            assert wait_for(children[0].signalled.exists)  # `stop` waits for it to exit
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=ctrl_c_once_stopping, daemon=True).start()
        for child in children:  # in the main thread, where the handler runs, as in `main`
            child.stop()
        assert [child.pid for child in children] == [None, None]
        # Alive until `stop`'s SIGTERM: the second SIGTERM above had not killed it.
        assert children[0].signalled.exists() and not children[1].signalled.exists()
    finally:  # a failure leaves no child behind
        signal.signal(signal.SIGINT, previous)
        for child in children:
            child.kill()


def test_ctrl_c_twice_before_any_child_started_ends_the_launcher() -> None:
    handle = stop_signal_handler(threading.Event(), [])
    handle(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        handle(signal.SIGINT, None)


def test_a_port_another_server_holds_stops_the_launcher_before_anything_starts(
    tmp_path: Path,
) -> None:
    """tritonserver would fail to bind it only after loading its models, while the other
    server's health URL answered for it: the launcher announced a server not its own."""
    held, reserved = free_ports(2)
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", held))
        other.listen()
        assert port_in_use("127.0.0.1", held)
        assert port_in_use("0.0.0.0", held)  # the adapter's default host
        assert not port_in_use("127.0.0.1", reserved)  # TIME_WAIT: a server may bind it
        args = ["--run-dir", str(tmp_path), "--grpc-port", str(held), "--adapter-port", "0"]
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            with pytest.raises(SystemExit, match=f"cannot serve: --grpc-port {held} is in use"):
                launcher_main(["--model-path", str(tmp_path / "not built"), *args])
        finally:  # main's own handlers go with it
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    assert not (tmp_path / "model_repository").exists()


@pytest.mark.parametrize("flag", ["--http-port", "--adapter-port"])
def test_a_port_out_of_range_is_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An int past 65535 wraps where tritonserver binds it (70000 -> 4464)."""
    with pytest.raises(SystemExit):
        parse_args([flag, "70000"])
    assert "70000 is not a port: 0-65535" in capsys.readouterr().err
    assert parse_args([flag, "0"]).__dict__[flag[2:].replace("-", "_")] == 0


@pytest.mark.parametrize("name", ["nonexistent", "a-folder"])
def test_a_tritonserver_that_is_no_executable_is_refused(tmp_path: Path, name: str) -> None:
    (tmp_path / "a-folder").mkdir()
    args = parse_args(["--tritonserver", str(tmp_path / name), "--run-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match=rf"--tritonserver .*{name}: no such executable"):
        build_server(args)


def test_a_tritonserver_on_path_passes_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare name is looked up on PATH, as Popen does (a review: it was refused)."""
    binary = tmp_path / "bin" / "tritonserver"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{binary.parent}:{os.environ['PATH']}")
    args = parse_args(["--tritonserver", "tritonserver", "--model-path", str(tmp_path / "none")])
    with pytest.raises(SystemExit, match=r"cannot serve .*none: "):  # past the binary's check
        build_server(args)


def test_a_host_that_does_not_resolve_is_a_message() -> None:
    args = parse_args(["--host", "no-such-host.invalid", "--adapter-port", "0"])
    message = "cannot serve: --http-port 8000 on no-such-host.invalid: "
    with pytest.raises(SystemExit, match=re.escape(message)):
        check_ports(args)


def test_an_ipv6_host_for_tritonserver_is_refused() -> None:
    """tritonserver 2.51 joins `--grpc-address` and the port with ":": `:::8001` fails as
    "already in use" after the models load."""
    with pytest.raises(SystemExit, match="--host ::: tritonserver binds IPv4 addresses"):
        check_ports(parse_args(["--host", "::", "--adapter-port", "0"]))


def test_a_bad_adapter_setting_stops_the_launcher_before_tritonserver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ADAPTER_* variable the adapter refuses would stop it only once the model loaded."""
    triton = type("Triton", (), {"grpc_url": "127.0.0.1:1"})()
    monkeypatch.setenv("ADAPTER_MAX_N", "0")
    with pytest.raises(SystemExit, match=r"cannot start the adapter .*: max_n: Input should be"):
        build_adapter(parse_args([]), triton)  # type: ignore[arg-type]
    monkeypatch.delenv("ADAPTER_MAX_N")
    assert build_adapter(parse_args([]), triton) is not None  # type: ignore[arg-type]
