"""The engine seam: one shared `tritonclient.grpc.aio` client, one gRPC stream per request.

Serving code depends on the `Engine` protocol only, so unit tests pass a fake.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Protocol

import grpc
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.utils import InferenceServerException

from adapter.errors import EngineError, EngineUnavailableError, TritonInputError
from adapter.tensors import (
    OUTPUT_NAMES,
    GenerationParams,
    TritonOutput,
    build_inputs,
    to_infer_inputs,
)
from backend.triton_io import (
    IGNORE_EOS,
    INPUT_IDS,
    LOGPROB_TOKEN_IDS,
    LOGPROBS,
    MAX_TOKENS,
    MESSAGES,
    SEED,
    STOP,
    STOP_TOKEN_IDS,
    TEMPERATURE,
    TEXT_INPUT,
    TOP_K,
    TOP_P,
)

logger = logging.getLogger(__name__)

INPUT_TENSORS = frozenset(
    {
        INPUT_IDS,
        TEXT_INPUT,
        MESSAGES,
        MAX_TOKENS,
        TEMPERATURE,
        TOP_P,
        TOP_K,
        SEED,
        STOP,
        STOP_TOKEN_IDS,
        IGNORE_EOS,
        LOGPROBS,
        LOGPROB_TOKEN_IDS,
    }
)

# The model reports bad input as "<TENSOR>: <detail>"; Triton may put a request-id tag in front.
_INPUT_ERROR = re.compile(r"^(?:\[request id: [^\]]*\]\s*)?([A-Z][A-Z0-9_]*): (.+)$", re.DOTALL)
_DRAIN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ModelInfo:
    """The `llm` model's config parameters the adapter validates against (read once, cached)."""

    max_model_len: int | None = None
    max_logprobs: int = 20
    max_logprob_token_ids: int = 1024
    model_path: str | None = None

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]) -> ModelInfo:
        """Parses config.pbtxt `parameters` (all strings); an absent one keeps the default."""
        defaults = cls()

        def integer(name: str, default: int | None) -> int | None:
            value = parameters.get(name, "").strip()
            return int(value) if value else default

        return cls(
            max_model_len=integer("max_model_len", defaults.max_model_len),
            max_logprobs=integer("max_logprobs", defaults.max_logprobs),
            max_logprob_token_ids=integer(
                "max_logprob_token_ids", defaults.max_logprob_token_ids
            ),
            model_path=parameters.get("model_path") or None,
        )

    @property
    def default_model_name(self) -> str:
        """The API model id when none is configured: the model folder's name."""
        return PurePath(self.model_path).name if self.model_path else "llm"


class Engine(Protocol):
    """What serving needs from Triton."""

    async def is_ready(self) -> bool:
        """Triton is up and both models are ready."""
        ...

    async def model_info(self) -> ModelInfo:
        """The generation model's limits; raises `EngineUnavailableError` if unreachable."""
        ...

    def generate(self, params: GenerationParams, request_id: str) -> AsyncIterator[TritonOutput]:
        """Streams the model's responses, the last one `final`; closing it cancels the request.

        Raises `TritonInputError` for input the model rejected, `EngineUnavailableError` when
        Triton or the model is not there, `EngineError` otherwise.
        """
        ...

    async def close(self) -> None:
        """Releases the connection."""
        ...


def error_from_triton(message: str) -> Exception:
    """Classifies an error message of a Triton stream (the stream drops the status code)."""
    match = _INPUT_ERROR.match(message)
    if match and match.group(1) in INPUT_TENSORS:
        return TritonInputError(match.group(1), match.group(2))
    if "Request for unknown model" in message:
        return EngineUnavailableError(message)
    return EngineError(message)


def error_from_rpc(exc: grpc.RpcError | InferenceServerException) -> Exception:
    """Maps a failed RPC: an unreachable Triton is 503, anything else 500."""
    if isinstance(exc, grpc.RpcError):
        code, message = exc.code(), exc.details() or str(exc)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return EngineUnavailableError(f"Triton is not reachable: {message}")
        return error_from_triton(message)
    status = exc.status() or ""
    if "UNAVAILABLE" in status or "DEADLINE_EXCEEDED" in status:
        return EngineUnavailableError(f"Triton is not reachable: {exc.message()}")
    return error_from_triton(exc.message() or str(exc))


class TritonEngine:
    """`Engine` over Triton's gRPC API; the client is made in the event loop that uses it."""

    def __init__(
        self, url: str, *, ensemble_model: str, llm_model: str, timeout_s: float
    ) -> None:
        self._url = url
        self._ensemble_model = ensemble_model
        self._llm_model = llm_model
        self._timeout_s = timeout_s
        self._client: grpcclient_aio.InferenceServerClient | None = None
        self._info: ModelInfo | None = None

    @property
    def client(self) -> grpcclient_aio.InferenceServerClient:
        if self._client is None:
            self._client = grpcclient_aio.InferenceServerClient(self._url)
        return self._client

    async def is_ready(self) -> bool:
        try:
            if not await self.client.is_server_ready(client_timeout=self._timeout_s):
                return False
            for model in (self._ensemble_model, self._llm_model):
                if not await self.client.is_model_ready(model, client_timeout=self._timeout_s):
                    return False
        except InferenceServerException as exc:
            logger.info("Triton is not ready: %s", exc)
            return False
        return True

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            try:
                response = await self.client.get_model_config(
                    self._llm_model, client_timeout=self._timeout_s
                )
            except InferenceServerException as exc:
                raise EngineUnavailableError(
                    f"cannot read the config of Triton model `{self._llm_model}`: {exc}"
                ) from exc
            parameters = {k: v.string_value for k, v in response.config.parameters.items()}
            self._info = ModelInfo.from_parameters(parameters)
            logger.info("Triton model `%s`: %s", self._llm_model, self._info)
        return self._info

    async def generate(
        self, params: GenerationParams, request_id: str
    ) -> AsyncIterator[TritonOutput]:
        model = self._llm_model if params.prompt_ids is not None else self._ensemble_model
        request: dict[str, Any] = {
            "model_name": model,
            "inputs": to_infer_inputs(build_inputs(params)),
            "request_id": request_id,
        }
        # No `triton_enable_empty_final_response`: the model sends FINAL with its last data.
        finished = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield request
            # Half-closing the stream early is legal, but holding it until the final response
            # keeps Triton from seeing a closed stream while the request still runs.
            await finished.wait()

        call = self.client.stream_infer(requests())
        completed = False
        try:
            async for result, error in call:
                if error is not None:
                    raise error_from_triton(error.message())
                final = result.get_response().parameters["triton_final_response"].bool_param
                output = TritonOutput.from_arrays(
                    {name: result.as_numpy(name) for name in OUTPUT_NAMES}, final=final
                )
                if final and output.finish_reason is None:
                    raise EngineError(f"model `{model}` sent a final response without a reason")
                if final:
                    completed = True
                    finished.set()
                yield output
                if final:
                    try:
                        await asyncio.wait_for(_drain(call), _DRAIN_TIMEOUT_S)
                    except asyncio.TimeoutError:
                        logger.warning("stream of request %s did not end; cancelled", request_id)
                        call.cancel()
                    return
            raise EngineError(f"Triton closed the stream of `{model}` before the final response")
        except (grpc.RpcError, InferenceServerException) as exc:
            raise error_from_rpc(exc) from exc
        finally:
            finished.set()
            if not completed:
                # Synchronous on purpose: this runs inside a cancelled task when the HTTP client
                # went away, where an await would be cancelled again. Triton then cancels the
                # request and the model frees the sequence.
                call.cancel()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


async def _drain(call: AsyncIterator[Any]) -> None:
    """Reads to the end of a finished stream, so the RPC ends with OK rather than dangling."""
    async for _ in call:
        logger.warning("Triton sent a response after the final one; ignored")
