"""A child server process: started in its own session, ready when an HTTP URL answers 200,
stopped with a signal and then, whatever is left of its process group, killed; restartable, and
able to say why it can no longer serve (`fault`), which `backend.supervisor` watches.

A child may run at a lower CPU priority (`nice`), so that it yields the CPUs to the engine when
they are short (docs/design.md, "The adapter's CPU priority")."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO, TypeVar

logger = logging.getLogger(__name__)
_Process = TypeVar("_Process", bound="ChildProcess")


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports for servers about to start, kept from other processes.

    A server binds its port seconds after it is chosen (tritonserver once its models are
    loaded), and meanwhile any process's `bind(0)` or outgoing connection could take a port
    that is merely free. So each port is left in TIME_WAIT, for about a minute: the kernel hands
    it to no ephemeral allocation, while a server binding it with SO_REUSEADDR, as tritonserver
    and uvicorn do, takes it (docs/design.md, "Ports chosen for servers")."""
    return [_reserved_port() for _ in range(count)]


def _reserved_port() -> int:
    with socket.socket() as listener:
        # Its accepted end inherits the flag, without which a server could not take it over.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port: int = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            accepted.close()  # the port's end closes first, so it is the end left in TIME_WAIT
    return port


def free_port() -> int:
    return free_ports(1)[0]


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on `port` at `host` already: tritonserver or uvicorn would fail
    to bind it, while the other server's health URL answered for them. Bound as they bind it
    (SO_REUSEADDR), so a port left in TIME_WAIT (`free_ports`) is free."""
    family, kind, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def lower_priority(pid: int, nice: int) -> None:
    """Sets the niceness of `pid`, a session leader just started, and of its session's
    autogroup.

    Linux schedules the tasks of a session as one group (autogroup) where the process's cgroup
    is the root one, as on a bare machine: groups share the CPUs as equals, whatever their
    tasks' niceness, so the group's own niceness is what yields to other sessions. Elsewhere
    (a container, a systemd unit) the threads' niceness is what counts: `pid` has no thread
    but its first yet (Popen returns once it has exec'd), and the threads it starts inherit.
    Best effort: a priority is no reason not to serve.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        autogroup = Path(f"/proc/{pid}/autogroup")
        if autogroup.exists():  # absent where the kernel has no autogroup
            autogroup.write_text(str(nice))
    except OSError as exc:
        logger.warning(
            "could not lower the CPU priority of process %d to nice %d: %s", pid, nice, exc
        )


class ChildProcess:
    """Subclasses give `command()`, `ready_url` and, if needed, `env()` and `stop_signal`."""

    stop_signal = signal.SIGTERM
    name = "process"

    def __init__(self, log_path: Path | None = None, nice: int = 0) -> None:
        self.log_path = log_path
        self.nice = nice
        """The child's niceness, and its session's scheduling group's (Linux); 0 leaves both."""
        self.restarts = 0
        """Starts after the first one (`backend.supervisor` restarts a faulty process)."""
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def ready_url(self) -> str:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    @property
    def pid(self) -> int | None:
        """The process id while started (also its process group's: it leads its session)."""
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def fault(self) -> str | None:
        """Why the started process can no longer serve; None while it can."""
        if self._process is not None and self._process.poll() is not None:
            return f"exited with {self._process.returncode}"
        return None

    def start(self) -> None:
        output: int | IO[bytes] = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            # A restart appends, so that the log still shows the fault that caused it.
            mode = "ab" if self.restarts else "wb"
            self._log = output = open(self.log_path, mode)  # noqa: SIM115 (closed in stop)
        command = self.command()
        logger.info("starting %s: %s", self.name, " ".join(command))
        # Its own session, so stop() also reaches what it forked (Triton's backend stubs).
        self._process = subprocess.Popen(
            command,
            env=self.env(),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if self.nice:
            lower_priority(self._process.pid, self.nice)

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.ready_url, timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 120.0, stop: threading.Event | None = None) -> bool:
        """True once ready; False if `stop` was set first (a SIGTERM during start-up)."""
        stop = stop or threading.Event()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self._process.returncode}\n{self.log_tail()}"
                )
            if self.is_ready():
                self.became_ready()
                return True
            if stop.wait(0.25):
                return False
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    @property
    def stop_timeout_s(self) -> float:
        """How long `stop` waits by default for the process to exit after `stop_signal`."""
        return 30.0

    def stop(self, timeout_s: float | None = None) -> None:
        """`stop_signal`, up to `timeout_s` (default `stop_timeout_s`) to exit, then SIGKILL to
        what is left of the group; 0 kills at once (a faulty process: a broken tritonserver
        waits its exit timeout)."""
        if timeout_s is None:
            timeout_s = self.stop_timeout_s
        process = self._process  # kept until reaped: `kill` may be called while this waits
        if process is not None:
            if process.poll() is None and timeout_s > 0:
                process.send_signal(self.stop_signal)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in %.0f s; killing it", self.name, timeout_s)
            with contextlib.suppress(ProcessLookupError):  # anything that outlived it
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            self._process = None
            self.stopped()
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL to the process group now, also while `stop` waits for it to exit (which then
        returns): Ctrl-C after a stop signal to the launcher. Not once the process is reaped,
        when its id could be another process's."""
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

    def became_ready(self) -> None:
        """Once `ready_url` answers: subclasses note what the ready process runs."""

    def stopped(self) -> None:
        """After the process group is gone: subclasses release what it left behind."""

    def start_ready(self: _Process, timeout_s: float = 120.0) -> _Process:
        """Starts it and waits until it is ready; stops it again if it never is."""
        self.start()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self: _Process) -> _Process:
        return self.start_ready()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
