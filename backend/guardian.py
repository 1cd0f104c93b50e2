"""Kills the launcher's children when the launcher dies, even by SIGKILL.

Each child server runs in a session of its own (so that stopping it reaches what it forked:
tritonserver's backend stubs), which also means nothing takes it down with the launcher; and
`PR_SET_PDEATHSIG` would not help, since it is not inherited by the stubs tritonserver forks.
So the launcher starts this guardian first, in a session of its own too, and tells it the
process group of every child it starts (`+pgid`) and stops (`-pgid`) on a pipe. When the pipe
closes without a clean `exit` line, the launcher is gone: the guardian SIGKILLs every group it
still knows, removes the shared-memory regions of the Python-backend stubs it killed (which
tritonserver would have removed on a clean stop), and exits. docs/design.md, "Surviving the
engine's death".

    python -m backend.guardian   # reads the protocol on stdin
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import IO

from backend.tritonserver import backend_stubs, remove_shm_regions


def guard(commands: IO[str]) -> set[int]:
    """Reads `+pgid` / `-pgid` / `exit` lines to the end; returns the groups to kill (none after
    `exit`)."""
    groups: set[int] = set()
    for line in commands:
        command = line.strip()
        if command == "exit":
            return set()
        if command[:1] in "+-" and command[1:].isdigit():
            (groups.add if command[0] == "+" else groups.discard)(int(command[1:]))
    return groups


def kill_groups(groups: set[int]) -> None:
    """SIGKILLs each group, then removes the regions of the stubs it held: a group is its
    leader's pid, and a tritonserver's stubs are its children."""
    regions = {
        stub.shm_region for group in groups for stub in backend_stubs(group) if stub.shm_region
    }
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    remove_shm_regions(regions)


class Guardian:
    """The launcher's side: starts the guardian process and reports its children to it."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        # Its own session: a SIGKILL to the launcher's process group does not reach it. It
        # ignores SIGINT and SIGTERM for the same reason (Ctrl-C reaches the foreground group).
        self._process = subprocess.Popen(
            [sys.executable, "-m", "backend.guardian"],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def watch(self, group: int) -> None:
        self._send(f"+{group}")

    def forget(self, group: int) -> None:
        self._send(f"-{group}")

    def close(self) -> None:
        """The launcher stopped its children itself: the guardian exits without killing."""
        process, self._process = self._process, None
        if process is not None:
            self._send_to(process, "exit")
            assert process.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                process.stdin.close()
            process.wait()

    def _send(self, line: str) -> None:
        if self._process is not None:
            self._send_to(self._process, line)

    @staticmethod
    def _send_to(process: subprocess.Popen[str], line: str) -> None:
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            process.stdin.write(line + "\n")
            process.stdin.flush()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kill_groups(guard(sys.stdin))


if __name__ == "__main__":
    main()
