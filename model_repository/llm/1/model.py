"""Triton glue for the generation engine: decoupled, each response carries the tokens generated
since the last one (one per response while the writer keeps up).

Tensor contract: docs/tensors.md. `execute` parses each request into `GenerationParams` and
hands it to the engine, which runs in a process of its own (`backend.engine_process`); its
outputs land in the request's outbox, and the response writer thread sends them
(`backend.response_writer`), the FINAL flag with the last response, exactly once, also on error
and cancellation.
"""

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import triton_python_backend_utils as pb_utils

from backend.config import RESTARTS_ENV, LLMConfig
from backend.engine import Engine, EngineStats
from backend.engine_process import EngineProcess
from backend.outputs import BUSY, CANCELLED, INVALID, StepOutput
from backend.params import GenerationParams, InvalidInputError
from backend.response_writer import ResponseWriter
from backend.triton_io import cancel_target, output_arrays, parse_request

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _error_code(kind: str) -> int:
    """pb_utils' classes exist only once the stub has imported this file: look them up late."""
    codes = {
        CANCELLED: pb_utils.TritonError.CANCELLED,
        BUSY: pb_utils.TritonError.UNAVAILABLE,
        INVALID: pb_utils.TritonError.INVALID_ARG,
    }
    return codes.get(kind, pb_utils.TritonError.INTERNAL)


@dataclass
class _Request:
    sender: Any
    """Triton's response sender, untyped like all of pb_utils (None after FINAL): sends, and
    answers `is_cancelled`, which python_backend documents for decoupled models once `execute`
    has returned."""
    params: GenerationParams
    output_names: frozenset[str]
    """What the client asked for (all outputs when it named none): only these are built."""


class _TritonTransport:
    """The writer's way out: Triton's response senders (writer thread only)."""

    def __init__(self, logger) -> None:
        self._logger = logger

    def send(self, request: _Request, output: StepOutput, final: bool) -> None:
        arrays = output_arrays(output, request.params, request.output_names)
        tensors = [pb_utils.Tensor(name, array) for name, array in arrays.items()]
        self._send(request, pb_utils.InferenceResponse(output_tensors=tensors), final)

    def send_error(self, request: _Request, message: str, kind: str) -> None:
        error = pb_utils.TritonError(message, _error_code(kind))
        self._send(request, pb_utils.InferenceResponse(error=error), True)

    def is_cancelled(self, request: _Request) -> bool:
        return request.sender is not None and request.sender.is_cancelled()

    def _send(self, request: _Request, response, final: bool) -> None:
        sender = request.sender
        if sender is None:
            return
        try:
            sender.send(response, flags=FINAL if final else 0)
        except Exception as exc:  # the client may be gone; the writer goes on
            self._logger.log_warn(f"request {request.params.request_id}: send failed: {exc}")
            if final:  # the request must still complete, or Triton never releases it
                try:
                    sender.send(flags=FINAL)
                except Exception as again:
                    self._logger.log_warn(
                        f"request {request.params.request_id}: FINAL failed: {again}"
                    )
        if final:
            request.sender = None


class _Metrics:
    """Engine counters on Triton's metrics port (custom metrics)."""

    _GAUGES = frozenset({"active_sequences", "waiting_requests", "kv_cache_usage"})

    def __init__(self, model_name: str) -> None:
        labels = {"model": model_name}
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        self._families = {
            "active_sequences": pb_utils.MetricFamily(
                "llm_active_sequences", "Sequences being generated", gauge
            ),
            "waiting_requests": pb_utils.MetricFamily(
                "llm_waiting_requests", "Requests waiting for a sequence slot", gauge
            ),
            "kv_cache_usage": pb_utils.MetricFamily(
                "llm_kv_cache_usage", "Fraction of KV-cache slots in use", gauge
            ),
            "generated_tokens": pb_utils.MetricFamily(
                "llm_generated_tokens_total", "Tokens generated", counter
            ),
            "cancelled_requests": pb_utils.MetricFamily(
                "llm_cancelled_requests_total", "Requests cancelled by their client", counter
            ),
            "finished_requests": pb_utils.MetricFamily(
                "llm_finished_requests_total", "Requests that finished generating", counter
            ),
            "grammar_compiles": pb_utils.MetricFamily(
                "llm_grammar_compiles_total", "Structured-output grammars compiled", counter
            ),
            "grammar_compile_seconds": pb_utils.MetricFamily(
                "llm_grammar_compile_seconds_total",
                "Time spent compiling structured-output grammars",
                counter,
            ),
            "grammar_cache_hits": pb_utils.MetricFamily(
                "llm_grammar_cache_hits_total",
                "Structured-output requests whose grammar was already compiled",
                counter,
            ),
        }
        self._metrics = {
            key: family.Metric(labels=labels) for key, family in self._families.items()
        }
        self._last = EngineStats()
        # The family must outlive its metric (python_backend deletes both with the family).
        self._restart_family = pb_utils.MetricFamily(
            "llm_server_restarts_total",
            "Times the launcher restarted tritonserver after a fault (a backend stub or the "
            "server died)",
            counter,
        )
        self._restarts = self._restart_family.Metric(labels=labels)
        if restarts := int(os.environ.get(RESTARTS_ENV, "0")):
            self._restarts.increment(restarts)

    def update(self, stats: EngineStats) -> None:
        for key, metric in self._metrics.items():
            value, last = getattr(stats, key), getattr(self._last, key)
            if value == last:
                continue
            if key in self._GAUGES:
                metric.set(value)
            else:
                metric.increment(value - last)
            setattr(self._last, key, value)


class TritonPythonModel:
    prepare_engine: Callable[[Engine], None] | None = None
    """Runs on the engine in its process before it starts (tests hold its steps with it)."""

    def initialize(self, args) -> None:
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                "llm streams a response per token: set model_transaction_policy { decoupled: true }"
            )
        self.logger = pb_utils.Logger
        config = LLMConfig.from_model_config(model_config, args["model_repository"])
        self.metrics = _Metrics(args["model_name"])
        self.writer: ResponseWriter[_Request, EngineStats] = ResponseWriter(
            _TritonTransport(self.logger),
            max_tokens_per_response=config.max_tokens_per_response,
            stream_interval_s=config.stream_interval_ms / 1000,
            stream_interval_tokens=config.stream_interval_tokens,
            on_stats=self.metrics.update,
        )
        self.engine = EngineProcess(
            config,
            on_stats=self.writer.publish_stats,
            on_death=self._engine_died,
            prepare=self.prepare_engine,
        )
        self.writer.start()
        ready = self.engine.start()
        self.limits = ready.limits
        self.logger.log_info(f"llm ready: {ready.description}")

    def _engine_died(self) -> None:
        """Every request in flight has its error in its outbox: send them, then end the stub,
        so that the launcher restarts the server (docs/design.md, "Surviving the engine's
        death"); python_backend would keep a stub without an engine "ready"."""
        self.logger.log_error("llm: the engine process died; ending this stub")
        self.writer.stop()
        os._exit(1)

    def execute(self, requests) -> None:
        for request in requests:
            arrays = {t.name(): t.as_numpy() for t in request.inputs()}
            try:
                target = cancel_target(arrays, request.request_id())
                if target is not None:
                    self._cancel(target, request.get_response_sender())
                    continue
                params = parse_request(arrays, self.limits, request.request_id())
            except InvalidInputError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=error), flags=FINAL
                )
                continue
            names = frozenset(request.requested_output_names())
            triton_request = _Request(request.get_response_sender(), params, names)
            self.engine.submit(params, self.writer.outbox(triton_request))
        return None

    def _cancel(self, request_id: str, sender) -> None:
        """A CANCEL request: ends the requests in flight with its id, and answers with one
        empty final response. Unlike a Triton cancellation, the target's stream then ends with
        its own FINAL, which the client reads (docs/design.md, "A Triton 2.51 hazard our clients
        avoid")."""
        found = self.writer.cancel(lambda target: target.params.request_id == request_id)
        self.logger.log_verbose(f"CANCEL {request_id}: {found} request(s) in flight")
        sender.send(flags=FINAL)

    def finalize(self) -> None:
        # In the log, so that a model that never unloads shows whether finalize began
        # (docs/design.md, "A Triton 2.51 hazard our clients avoid").
        self.logger.log_info("llm finalize: stopping the engine, then the writer")
        self.engine.stop()  # every request in flight gets its final error in its outbox
        self.writer.stop()  # which the writer sends, with the last stats, before it ends
