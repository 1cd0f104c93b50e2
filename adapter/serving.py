"""What both endpoints' serving share: server limits, the Triton stream, SSE framing."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from typing import ClassVar

from pydantic import BaseModel

from adapter.errors import EngineError, InvalidRequestError, TritonInputError, error_response
from adapter.models import OpenAIServingModels
from adapter.tensors import GenerationParams, TritonOutput
from adapter.triton_client import Engine, ModelInfo
from backend.triton_io import (
    ADD_SPECIAL_TOKENS,
    IGNORE_EOS,
    LOGPROB_TOKEN_IDS,
    MAX_TOKENS,
    SEED,
    STOP,
    STOP_TOKEN_IDS,
    TEMPERATURE,
    TOP_K,
    TOP_P,
)

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""No caching, and no buffering in nginx-style proxies, so each token leaves at once."""

SAMPLING_TENSOR_PARAMS: Mapping[str, str] = {
    ADD_SPECIAL_TOKENS: "add_special_tokens",
    MAX_TOKENS: "max_tokens",
    TEMPERATURE: "temperature",
    TOP_P: "top_p",
    TOP_K: "top_k",
    SEED: "seed",
    STOP: "stop",
    STOP_TOKEN_IDS: "stop_token_ids",
    IGNORE_EOS: "ignore_eos",
    LOGPROB_TOKEN_IDS: "logprob_token_ids",
}
"""Triton input -> request field, for the inputs both endpoints send alike."""


def sse_event(payload: BaseModel) -> str:
    """One SSE event; unset fields are left out, so a delta carries only what changed."""
    return f"data: {payload.model_dump_json(exclude_unset=True)}\n\n"


def sse_error(exc: Exception) -> str:
    """The error event of a stream that already started: the OpenAI error object as data."""
    _, body = error_response(exc)
    return f"data: {body.model_dump_json()}\n\n"


class OpenAIServing:
    """Base of the endpoint servings; subclasses name the fields behind each Triton input."""

    tensor_params: ClassVar[Mapping[str, str]]

    def __init__(self, engine: Engine, models: OpenAIServingModels) -> None:
        self.engine = engine
        self.models = models

    @staticmethod
    def check_limits(
        info: ModelInfo,
        *,
        top_logprobs: int | None,
        top_logprobs_param: str,
        logprob_token_ids: Sequence[int] | None,
    ) -> None:
        """The rules that need the model's configured maxima (DESIGN §4)."""
        if top_logprobs is not None and top_logprobs > info.max_logprobs:
            raise InvalidRequestError(
                f"`{top_logprobs_param}` must be at most {info.max_logprobs} (got {top_logprobs}).",
                parameter=top_logprobs_param,
                value=top_logprobs,
            )
        if logprob_token_ids is not None and len(logprob_token_ids) > info.max_logprob_token_ids:
            raise InvalidRequestError(
                f"`logprob_token_ids` holds {len(logprob_token_ids)} ids; at most "
                f"{info.max_logprob_token_ids} are allowed.",
                parameter="logprob_token_ids",
            )

    async def outputs(
        self, params: GenerationParams, request_id: str
    ) -> AsyncGenerator[TritonOutput, None]:
        """The model's responses; input it rejects becomes a 400 naming the request field."""
        async with aclosing(self.engine.generate(params, request_id)) as stream:
            try:
                async for output in stream:
                    yield output
            except TritonInputError as exc:
                raise InvalidRequestError(
                    f"{self.tensor_params.get(exc.tensor, exc.tensor)}: {exc.detail}",
                    parameter=self.tensor_params.get(exc.tensor),
                ) from exc

    async def collect(self, params: GenerationParams, request_id: str) -> list[TritonOutput]:
        """All responses of a non-streamed request, the last one final."""
        outputs = [output async for output in self.outputs(params, request_id)]
        if not outputs or not outputs[-1].final:
            raise EngineError("Triton ended the stream before the final response")
        return outputs

    async def start_stream(
        self, params: GenerationParams, request_id: str
    ) -> AsyncGenerator[TritonOutput, None]:
        """Waits for the first response before the SSE stream starts.

        The model answers bad input with an error as its first response; raising it here
        makes it a plain HTTP 400 instead of an error event inside a 200 stream.
        """
        outputs = self.outputs(params, request_id)
        try:
            first = await anext(outputs)
        except StopAsyncIteration:
            raise EngineError("Triton ended the stream without a response") from None
        except BaseException:
            await outputs.aclose()
            raise
        return _prepend(first, outputs)


async def _prepend(
    first: TritonOutput, rest: AsyncGenerator[TritonOutput, None]
) -> AsyncGenerator[TritonOutput, None]:
    async with aclosing(rest):
        yield first
        async for output in rest:  # after a final first response: lets the engine end the RPC
            yield output
