"""Processes read from /proc: the tree below a pid, what still runs, and resident memory."""

from __future__ import annotations

import contextlib
from pathlib import Path


def _process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state letter, command line) of every process we may read."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        state, ppid = _state_and_parent(stat)
        if state == "Z":
            state = _live_thread_state(entry) or state
        table[int(entry.name)] = (int(ppid), state, cmdline.strip())
    return table


def _state_and_parent(stat: str) -> tuple[str, str]:
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it.
    state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
    return state, ppid


def _live_thread_state(entry: Path) -> str | None:
    """The state of a thread still exiting under a zombie leader: a killed process's main thread
    can be a zombie while its other threads still hold its files (its listening sockets)."""
    with contextlib.suppress(OSError):
        for task in (entry / "task").iterdir():
            with contextlib.suppress(OSError):
                state = _state_and_parent((task / "stat").read_text())[0]
                if state not in ("Z", "X"):
                    return state
    return None


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process below `root` (its children, theirs, ...)."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][2]
        todo.extend(children.get(pid, []))
    return found


def still_running(processes: dict[int, str]) -> dict[int, str]:
    """Those of `processes` that still run: same pid and command line, and not a zombie (an exited
    process its new parent has not reaped yet holds no resources)."""
    table = _process_table()
    return {
        pid: cmd
        for pid, cmd in processes.items()
        if pid in table and table[pid][2] == cmd and table[pid][1] != "Z"
    }


def processes_mentioning(text: str) -> dict[int, str]:
    return {
        pid: cmd
        for pid, (_, state, cmd) in _process_table().items()
        if text in cmd and state != "Z"
    }


def resident_kib(pid: int) -> int:
    """VmRSS of `pid` from /proc/<pid>/status, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise LookupError(f"no VmRSS for pid {pid}")
