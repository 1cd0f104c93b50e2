"""The launcher's children, started in order, watched, and restarted when they fault.

A fault is a child that exited, or for tritonserver a backend stub that died (the engine's
process: an out-of-memory kill, a crash in torch). A faulty tritonserver is killed at once, its
group and shared memory included: its streams then end with an error at the client instead of
hanging, and Triton reports not-ready while it is down. Then it starts again on the same ports,
after a backoff that doubles with each fault in the window; past `max_restarts` faults in the
window the launcher gives up and exits 1, so that the container's supervisor takes over.
docs/design.md, "Surviving the engine's death".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backend.guardian import Guardian
from backend.processes import ChildProcess

logger = logging.getLogger("launcher")


@dataclass(frozen=True)
class RestartPolicy:
    """How often a faulty child is restarted before the launcher gives up."""

    max_restarts: int = 5
    """Restarts allowed within `window_s`; one more fault and the launcher exits 1."""
    window_s: float = 600.0
    backoff_s: float = 1.0
    """The wait before the first restart in the window; doubles with each further one."""
    max_backoff_s: float = 30.0
    poll_interval_s: float = 0.5
    """How often the children are checked: a dead engine is noticed this soon."""

    def backoff(self, faults_in_window: int) -> float:
        return min(self.backoff_s * 2 ** max(0, faults_in_window - 1), self.max_backoff_s)


class Supervisor:
    """Runs `processes` in order until `stop` is set, or until one cannot be healed."""

    def __init__(
        self,
        processes: Sequence[ChildProcess],
        stop: threading.Event,
        ready_timeout_s: float,
        policy: RestartPolicy = RestartPolicy(),
    ) -> None:
        self.processes = list(processes)
        self.stop = stop
        self.ready_timeout_s = ready_timeout_s
        self.policy = policy
        self._guardian = Guardian()
        self._faults: dict[str, list[float]] = {}

    def run(self, on_ready: Callable[[], None]) -> int:
        """0 when stopped, 1 when a child could not be healed; every child is stopped either way.

        A child that fails its first start is not restarted (a wrong flag or a model that does
        not load would fail again): that raises."""
        self._guardian.start()
        try:
            for process in self.processes:
                self._start(process)
                if not process.wait_ready(self.ready_timeout_s, self.stop):
                    return 0  # stopped while starting
            on_ready()
            while not self.stop.wait(self.policy.poll_interval_s):
                for process in self.processes:
                    fault = process.fault()
                    if fault is not None and not self._heal(process, fault):
                        return 1
            return 0
        finally:
            for process in reversed(self.processes):
                logger.info("stopping %s", process.name)
                self._stop(process)
            self._guardian.close()

    def _heal(self, process: ChildProcess, fault: str) -> bool:
        """Restarts `process` until it is ready again (True; also when stopped meanwhile), or
        False when it faulted too often."""
        while True:
            now = time.monotonic()
            window_start = now - self.policy.window_s
            earlier = [t for t in self._faults.get(process.name, []) if t > window_start]
            self._faults[process.name] = recent = [*earlier, now]
            tail = process.log_tail()
            self._stop(process, timeout_s=0)
            if len(recent) > self.policy.max_restarts:
                logger.error(
                    "%s: %s; giving up after %d faults in %.0f s\n%s",
                    process.name,
                    fault,
                    len(recent),
                    self.policy.window_s,
                    tail,
                )
                return False
            delay = self.policy.backoff(len(recent))
            logger.error(
                "%s: %s; restarting it in %.1f s (restart %d, at most %d in %.0f s)\n%s",
                process.name,
                fault,
                delay,
                process.restarts + 1,
                self.policy.max_restarts,
                self.policy.window_s,
                tail,
            )
            if self.stop.wait(delay):
                return True
            process.restarts += 1
            self._start(process)
            try:
                if process.wait_ready(self.ready_timeout_s, self.stop):
                    logger.info("%s is ready again (restart %d)", process.name, process.restarts)
                return True
            except (RuntimeError, TimeoutError) as exc:  # exited, or not ready in time
                fault = f"restart {process.restarts} failed: {exc}"

    def _start(self, process: ChildProcess) -> None:
        process.start()
        assert process.pid is not None
        self._guardian.watch(process.pid)

    def _stop(self, process: ChildProcess, timeout_s: float | None = None) -> None:
        pid = process.pid
        process.stop(timeout_s)
        if pid is not None:
            self._guardian.forget(pid)
