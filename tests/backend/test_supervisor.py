"""The supervisor's restart policy and the guardian's protocol, on small real processes
(`sleep`): killing one is the fault, as a dead engine is for tritonserver
(tests/integration/test_engine_death.py runs the real one)."""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
from collections.abc import Iterator

import pytest

from backend.guardian import guard
from backend.processes import ChildProcess
from backend.supervisor import RestartPolicy, Supervisor
from tests.integration.openai_support import wait_for

QUICK = RestartPolicy(max_restarts=2, window_s=600, backoff_s=0.01, poll_interval_s=0.01)


class Sleeper(ChildProcess):
    """Ready once started; after `fail_restarts_from` restarts, every start exits at once."""

    def __init__(self, name: str, fail_restarts_from: int | None = None) -> None:
        super().__init__()
        self.name = name
        self.fail_restarts_from = fail_restarts_from
        self.starts: list[int] = []

    def command(self) -> list[str]:
        failing = self.fail_restarts_from is not None and self.restarts >= self.fail_restarts_from
        self.starts.append(self.restarts)
        return [sys.executable, "-c", "raise SystemExit(3)"] if failing else ["sleep", "600"]

    def is_ready(self) -> bool:
        return True


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


def run_in_thread(supervisor: Supervisor) -> tuple[threading.Thread, list[int]]:
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(supervisor.run(lambda: None)))
    thread.start()
    return thread, exit_code


def kill(process: ChildProcess) -> None:
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)


def test_the_guardian_kills_the_groups_it_still_knows_unless_told_to_exit() -> None:
    assert guard(io.StringIO("+10\n+11\n-10\n+12\n")) == {11, 12}
    assert guard(io.StringIO("+10\n+11\nexit\n")) == set()
    assert guard(io.StringIO("+10\ngarbage\n+x\n")) == {10}


def test_the_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.backoff(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_process_that_dies_is_restarted_and_the_others_keep_running(
    stop: threading.Event,
) -> None:
    first, second = Sleeper("first"), Sleeper("second")
    supervisor = Supervisor([first, second], stop, ready_timeout_s=60, policy=QUICK)
    thread, exit_code = run_in_thread(supervisor)
    assert wait_for(lambda: second.running)
    second_pid = second.pid
    for restart in (1, 2):
        old = first.pid
        kill(first)
        assert wait_for(lambda n=restart: first.restarts == n and first.running)
        assert first.pid != old
    assert second.pid == second_pid  # untouched
    stop.set()
    thread.join()
    assert exit_code == [0]
    assert first.starts == [0, 1, 2]
    assert not first.running and not second.running


def test_past_max_restarts_in_the_window_it_gives_up_with_1(stop: threading.Event) -> None:
    """Every restart exits at once: the first start, then `max_restarts` restarts, then 1."""
    process, other = Sleeper("crashing", fail_restarts_from=1), Sleeper("other")
    supervisor = Supervisor([process, other], stop, ready_timeout_s=60, policy=QUICK)
    thread, exit_code = run_in_thread(supervisor)
    assert wait_for(lambda: other.running)
    kill(process)
    thread.join()
    assert exit_code == [1]
    assert process.starts == [0, 1, 2]
    assert not process.running and not other.running  # everything stopped on the way out


def test_faults_outside_the_window_do_not_count(stop: threading.Event) -> None:
    policy = RestartPolicy(max_restarts=1, window_s=0.0, backoff_s=0.01, poll_interval_s=0.01)
    process = Sleeper("flaky")
    thread, exit_code = run_in_thread(Supervisor([process], stop, 60, policy))
    for restart in (1, 2, 3):  # more than max_restarts, each alone in its window
        assert wait_for(lambda: process.running)
        kill(process)
        assert wait_for(lambda n=restart: process.restarts == n and process.running)
    stop.set()
    thread.join()
    assert exit_code == [0]
