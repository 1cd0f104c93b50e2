"""What the numbers were measured on, and how much of the CPU others took meanwhile.

The benchmark machine is shared (2 cores, other jobs come and go), so every run records the
share of all CPUs used by processes outside this benchmark's own process tree (and stolen by the
hypervisor) while it ran: a run with a large share is noise, not a result. A served run also
records how long the engine waited for a CPU (`Waiting`): on 2 CPUs the serving processes take
it from the engine, whose step bounds throughput. `OthersCpu` also keeps the CPU time this
benchmark's own processes (servers and client) used: per token, a cost that the VM's swings in
speed move much less than they move a run's wall time.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from pathlib import Path
from typing import TypeVar

import psutil


def describe_machine() -> str:
    """One line: CPU model, CPU count, architecture, accelerator, library versions."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    gpu = "a CUDA GPU" if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} CPUs, {platform.machine()}, {gpu}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )


def _tree_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) of this process and each of its descendants, by pid."""
    me = psutil.Process()
    times = {}
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            cpu = process.cpu_times()
            times[process.pid] = cpu.user + cpu.system
    return times


def _machine_busy_s() -> float:
    """CPU seconds the machine spent not idle, summed over CPUs; stolen time counts as busy."""
    cpu = psutil.cpu_times()
    return sum(cpu) - cpu.idle - getattr(cpu, "iowait", 0.0)


def thread_schedstats(pid: int) -> dict[int, tuple[float, float]]:
    """Each thread's seconds on a CPU and runnable in a run queue, from Linux's schedstat."""
    stats = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread may end meanwhile
            running, queued, _ = (task / "schedstat").read_text().split()
            stats[int(task.name)] = (int(running) / 1e9, int(queued) / 1e9)
    return stats


def _queued_s(pid: int) -> float:
    return sum(queued for _, queued in thread_schedstats(pid).values())


class _TimedBlock:
    """A context manager over a block: subclasses read their counters in `_begin` and, with
    the block's length, set `share` in `_end`."""

    share: float = float("nan")

    def __enter__(self: _Block) -> _Block:
        self._start = time.monotonic()
        self._begin()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._end(time.monotonic() - self._start)

    def _begin(self) -> None:
        raise NotImplementedError

    def _end(self, elapsed_s: float) -> None:
        raise NotImplementedError


_Block = TypeVar("_Block", bound=_TimedBlock)


class Waiting(_TimedBlock):
    """`share`: the fraction of the block during which the threads of process `pid` were
    runnable but waited for a CPU, summed over threads (NaN without a pid)."""

    def __init__(self, pid: int | None) -> None:
        self._pid = pid

    def _begin(self) -> None:
        self._queued = _queued_s(self._pid) if self._pid is not None else 0.0

    def _end(self, elapsed_s: float) -> None:
        if self._pid is not None:
            self.share = (_queued_s(self._pid) - self._queued) / elapsed_s


class OthersCpu(_TimedBlock):
    """`share`: the fraction of all CPUs that processes outside this benchmark's tree (or the
    hypervisor) used during the block; `ours_s`: the CPU seconds the tree used."""

    ours_s: float = float("nan")

    def _begin(self) -> None:
        self._busy = _machine_busy_s()
        self._ours = _tree_cpu_s()

    def _end(self, elapsed_s: float) -> None:
        self.ours_s = sum(t - self._ours.get(pid, 0.0) for pid, t in _tree_cpu_s().items())
        capacity = elapsed_s * (os.cpu_count() or 1)
        self.share = max(_machine_busy_s() - self._busy - self.ours_s, 0.0) / capacity


def wait_until_quiet(max_wait_s: float, threshold: float, window_s: float = 1.0) -> float:
    """Waits, at most `max_wait_s`, for a `window_s` in which others used under `threshold` of
    the CPUs; returns the share of the last window (the machine is shared, runs are short)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with OthersCpu() as others:
            time.sleep(window_s)
        if others.share < threshold or time.monotonic() >= deadline:
            return others.share
