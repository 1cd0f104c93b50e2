"""A small tritonclient gRPC streaming helper for tests: one request, all its responses."""

from __future__ import annotations

import json
import queue
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from backend import contract


def infer_inputs(arrays: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in arrays.items():
        array = np.asarray(array)
        dtype = "BYTES" if array.dtype == object else np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


@dataclass
class StreamResult:
    responses: list[dict[str, np.ndarray]] = field(default_factory=list)
    error: str | None = None

    def cat(self, name: str) -> np.ndarray:
        return np.concatenate([r[name] for r in self.responses])

    @property
    def token_ids(self) -> list[int]:
        return self.cat(contract.OUTPUT_IDS).tolist()

    @property
    def text(self) -> str:
        return "".join(r[contract.TEXT_OUTPUT][0].decode() for r in self.responses)

    @property
    def finish_reason(self) -> str:
        return self.responses[-1][contract.FINISH_REASON][0].decode()

    @property
    def stop_reason(self) -> object:
        """The final response's STOP_REASON, parsed (""s before it)."""
        assert [r[contract.STOP_REASON][0] for r in self.responses[:-1]] == [b""] * (
            len(self.responses) - 1
        )
        return json.loads(self.responses[-1][contract.STOP_REASON][0])


def _is_final(result: grpcclient.InferResult) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


class Streamer:
    """One gRPC stream; `run` sends a request and collects responses up to the FINAL one."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self._queue: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self._queue.put((result, error)))

    def send(
        self,
        model: str,
        arrays: dict[str, np.ndarray],
        request_id: str = "",
        empty_final: bool = False,
    ) -> None:
        """`empty_final`: a final response without outputs reaches `next` too."""
        self.client.async_stream_infer(
            model,
            infer_inputs(arrays),
            request_id=request_id,
            enable_empty_final_response=empty_final,
        )

    def next(self, timeout: float = 60.0) -> tuple[dict[str, np.ndarray] | None, str | None, bool]:
        """(outputs, error message, final) of the next response."""
        result, error = self._queue.get(timeout=timeout)
        if error is not None:
            message = error.message() if isinstance(error, InferenceServerException) else str(error)
            return None, message, True
        outputs = {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
        return outputs, None, _is_final(result)

    def collect(self, timeout: float = 60.0) -> StreamResult:
        out = StreamResult()
        while True:
            outputs, error, final = self.next(timeout)
            if error is not None:
                out.error = error
                return out
            out.responses.append(outputs)
            if final:
                return out

    def run(self, model: str, arrays: dict[str, np.ndarray], timeout: float = 60.0) -> StreamResult:
        self.send(model, arrays)
        return self.collect(timeout)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def generate(url: str, model: str, arrays: dict[str, np.ndarray]) -> StreamResult:
    streamer = Streamer(url)
    try:
        return streamer.run(model, arrays)
    finally:
        streamer.close()
