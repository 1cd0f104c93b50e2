"""The engine's output sink for tests and checks: it keeps a request's outputs and its end."""

from __future__ import annotations

import threading

import numpy as np

from backend.outputs import INTERNAL, StepOutput


class RecordingSink:
    """Collects a request's outputs and its error (with its kind); `done` is set by the last.
    Reports cancelled once `cancel_after` outputs arrived."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.outputs: list[StepOutput] = []
        self.error: str | None = None
        self.kind: str | None = None
        self.done = threading.Event()
        self._cancel_after = cancel_after

    def send(self, output: StepOutput) -> None:
        assert not self.done.is_set(), "a response after the final one"
        self.outputs.append(output)
        if output.finish_reason is not None:
            self.done.set()

    def send_error(self, message: str, *, kind: str = INTERNAL) -> None:
        assert not self.done.is_set(), "an error after the final response"
        self.error, self.kind = message, kind
        self.done.set()

    def is_cancelled(self) -> bool:
        return self._cancel_after is not None and len(self.outputs) >= self._cancel_after

    @property
    def token_ids(self) -> list[int]:
        return [t for out in self.outputs for t in out.token_ids]

    @property
    def logprobs(self) -> np.ndarray:
        return np.concatenate([out.logprobs for out in self.outputs])

    @property
    def id_logprobs(self) -> np.ndarray:
        return np.concatenate([out.token_id_logprobs for out in self.outputs])
