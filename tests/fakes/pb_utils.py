"""A small, explicit fake of `triton_python_backend_utils` for driving model.py in-process.

Only what the repository's models use, with the real module's names and signatures
(triton-inference-server/python_backend README), and checks where the real stub would refuse:
a Tensor needs a numpy array, a sender refuses a response after FINAL, a counter only goes up.

The real module is a Python file (constants and helper functions, `PYTHON_NAMES`) to which the
C++ stub adds its classes (`STUB_NAMES`) only after model.py has been imported; the test loader
(tests/backend/conftest.py) stages a module the same way, so model.py cannot touch a class at
import time. `FakeRequest`, `metric` and `reset` are for tests only.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any, ClassVar

import numpy as np

from tests.backend.triton_config import config_tensors

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class TritonModelException(Exception):
    """What `initialize`/`execute` raise to fail the model or the request batch."""


class TritonError:
    """An error response's payload; codes as in TRITONSERVER_Error_Code."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"


class Tensor:
    _KINDS = frozenset("biufO")  # bool, ints, floats, and object arrays of bytes (TYPE_STRING)

    def __init__(self, name: str, array: np.ndarray) -> None:
        if not isinstance(array, np.ndarray):
            raise TritonModelException(f"tensor {name}: expected a numpy array, got {type(array)}")
        if array.dtype.kind not in self._KINDS:
            raise TritonModelException(f"tensor {name}: unsupported dtype {array.dtype}")
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(
        self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None
    ) -> None:
        self._tensors = list(output_tensors or [])
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def error(self) -> TritonError | None:
        return self._error

    def has_error(self) -> bool:
        return self._error is not None

    def as_arrays(self) -> dict[str, np.ndarray]:
        """Test helper: output name -> array."""
        return {tensor.name(): tensor.as_numpy() for tensor in self._tensors}


class ResponseSender:
    """Records every `send(response, flags)`; `final` is set when a FINAL flag arrives.

    `on_send`, when given, runs in the sending thread after each recorded send: a test can
    react to the n-th response at exactly that point (e.g. cancel the request).
    """

    def __init__(self, is_cancelled: Callable[[], bool] = lambda: False) -> None:
        """`is_cancelled`: the request's cancel flag, which Triton's sender answers too."""
        self.is_cancelled = is_cancelled
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.final = threading.Event()
        self.on_send: Callable[[InferenceResponse | None, int], None] | None = None
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        with self._lock:
            closed = self.final.is_set()
            self.sent.append((response, flags))
            if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                self.final.set()
        if closed:
            raise TritonModelException("Unable to send response: the response sender is closed")
        if self.on_send is not None:
            self.on_send(response, flags)

    @property
    def final_count(self) -> int:
        return sum(1 for _, flags in self.sent if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @property
    def responses(self) -> list[InferenceResponse]:
        return [response for response, _ in self.sent if response is not None]


class FakeRequest:
    """An InferenceRequest: named input arrays, an id, one response sender, a cancel flag."""

    def __init__(
        self,
        inputs: Mapping[str, np.ndarray],
        request_id: str = "",
        cancelled: bool = False,
        requested_outputs: Collection[str] = (),
    ) -> None:
        """`requested_outputs`: what the client named; none means all, as in Triton."""
        self._inputs = [Tensor(name, array) for name, array in inputs.items()]
        self._request_id = request_id
        self.cancelled = cancelled
        self.sender = ResponseSender(lambda: self.cancelled)
        self._requested = set(requested_outputs)

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def request_id(self) -> str:
        return self._request_id

    def get_response_sender(self) -> ResponseSender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self.cancelled

    def requested_output_names(self) -> set[str]:
        return set(self._requested or config_tensors("llm", "output"))


def get_input_tensor_by_name(request: FakeRequest, name: str) -> Tensor | None:
    return next((tensor for tensor in request.inputs() if tensor.name() == name), None)


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    return bool((model_config.get("model_transaction_policy") or {}).get("decoupled", False))


class Metric:
    """Holds its family weakly, as python_backend's does: once the family object is collected,
    the metric fails as the real one does."""

    def __init__(self, family: MetricFamily, labels: Mapping[str, str]) -> None:
        self._family = weakref.ref(family)
        self.labels = dict(labels)
        self.history: list[float] = []
        self._value = 0.0

    @property
    def family(self) -> MetricFamily:
        family = self._family()
        if family is None:
            raise TritonModelException(
                "Invalid metric operation as the corresponding 'MetricFamily' has been deleted."
            )
        return family

    def set(self, value: float) -> None:
        if self.family.kind != MetricFamily.GAUGE:
            raise TritonModelException(f"{self.family.name}: set() is only for gauges")
        self._value = float(value)
        self.history.append(self._value)

    def increment(self, value: float) -> None:
        if self.family.kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException(f"{self.family.name}: a counter cannot decrease ({value})")
        self._value += float(value)
        self.history.append(self._value)

    def value(self) -> float:
        return self._value


class MetricFamily:
    COUNTER = 0
    GAUGE = 1

    registry: ClassVar[weakref.WeakValueDictionary[str, MetricFamily]] = (
        weakref.WeakValueDictionary()
    )
    """Every live family created since `reset()`, by name, so tests can read metrics; weak,
    since the real families die with their Python objects."""

    def __init__(self, name: str, description: str, kind: int) -> None:
        if kind not in (self.COUNTER, self.GAUGE):
            raise TritonModelException(f"{name}: unknown metric kind {kind}")
        self.name = name
        self.description = description
        self.kind = kind
        self.metrics: list[Metric] = []
        MetricFamily.registry[name] = self

    def Metric(self, labels: Mapping[str, str] | None = None) -> Metric:
        metric = Metric(self, labels or {})
        self.metrics.append(metric)
        return metric


class Logger:
    """`pb_utils.Logger`: static log methods; records (level, message)."""

    records: list[tuple[str, str]] = []  # noqa: RUF012

    @staticmethod
    def log_info(message: str) -> None:
        Logger.records.append(("info", message))

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.records.append(("warn", message))

    @staticmethod
    def log_error(message: str) -> None:
        Logger.records.append(("error", message))

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.records.append(("verbose", message))


def metric(name: str, labels: Mapping[str, str] | None = None) -> Metric:
    """Test helper: the one metric of family `name` (with `labels`, when given)."""
    family = MetricFamily.registry[name]
    matches = [m for m in family.metrics if labels is None or m.labels == dict(labels)]
    if len(matches) != 1:
        raise KeyError(f"{name}: {len(matches)} metrics match labels {labels}")
    return matches[0]


def reset() -> None:
    """Forget metric families and log records (between tests)."""
    MetricFamily.registry.clear()
    Logger.records.clear()


PYTHON_NAMES = (
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "get_input_tensor_by_name",
    "using_decoupled_model_transaction_policy",
)
"""Defined by triton_python_backend_utils.py itself: present while model.py is imported."""
STUB_NAMES = (
    "InferenceResponse",
    "Logger",
    "MetricFamily",
    "Tensor",
    "TritonError",
    "TritonModelException",
)
"""Added by the C++ stub once model.py is imported."""
