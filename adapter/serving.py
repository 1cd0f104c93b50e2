"""What the endpoints' serving shares: server limits, Triton streams (several at once), SSE."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import aclosing, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, cast

from pydantic import BaseModel

from adapter.context import current_request
from adapter.engine_client import EngineClient, ModelInfo
from adapter.errors import (
    EXPECTED_ERRORS,
    EngineError,
    InvalidRequestError,
    TritonInputError,
    error_response,
)
from adapter.metrics import AdapterMetrics
from adapter.models import OpenAIServingModels
from adapter.protocol import INT32_MAX, StreamOptions, UsageInfo
from adapter.settings import AdapterSettings
from adapter.tensors import LogprobRows, TritonOutput, TritonRequest
from backend import contract

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class JSONBody:
    """A non-streamed response's JSON, made off the event loop (`build_full_response`)."""

    text: str


def _logprob_entries(outputs: Sequence[Sequence[TritonOutput]]) -> int:
    """Positions and their alternatives, generated and prompt ones, over every choice."""

    def rows(table: LogprobRows, positions: int) -> int:
        return (
            positions + sum(map(len, table.requested_logprobs)) + sum(map(len, table.top_logprobs))
        )

    return sum(
        rows(output, len(output.output_ids))
        + (0 if output.prompt is None else rows(output.prompt, len(output.prompt.ids)))
        for choice in outputs
        for output in choice
    )


LARGE_RESPONSE_ENTRIES = 100_000
"""Logprob entries (positions x alternatives) from which a non-streamed response is built one
at a time per endpoint: its Python objects take about 0.5 KB an entry, and 16 responses of 2M
entries built at once peaked at 8.5 GB in the adapter (an audit's measurement)."""

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""No caching, and no buffering in nginx-style proxies, so each token leaves at once."""

SAMPLING_TENSOR_PARAMS: Mapping[str, str] = {
    contract.ADD_SPECIAL_TOKENS: "add_special_tokens",
    contract.MAX_TOKENS: "max_tokens",
    contract.TEMPERATURE: "temperature",
    contract.TOP_P: "top_p",
    contract.TOP_K: "top_k",
    contract.MIN_P: "min_p",
    contract.SEED: "seed",
    contract.STOP: "stop",
    contract.STOP_TOKEN_IDS: "stop_token_ids",
    contract.INCLUDE_STOP_STR_IN_OUTPUT: "include_stop_str_in_output",
    contract.IGNORE_EOS: "ignore_eos",
    contract.MIN_TOKENS: "min_tokens",
    contract.PRESENCE_PENALTY: "presence_penalty",
    contract.FREQUENCY_PENALTY: "frequency_penalty",
    contract.REPETITION_PENALTY: "repetition_penalty",
    contract.LOGIT_BIAS_IDS: "logit_bias",
    contract.LOGIT_BIAS_VALUES: "logit_bias",
    contract.ALLOWED_TOKEN_IDS: "allowed_token_ids",
    contract.LOGPROB_TOKEN_IDS: "logprob_token_ids",
}
"""Triton input -> request field, for the inputs both endpoints send alike."""


_TENSOR_NAME = re.compile(r"\b[A-Z][A-Z0-9_]*[A-Z0-9]\b")
"""A Triton input's name in the list of `contract.NO_TOKEN_FITS`, which `field_errors` renames
to the request field behind it; other messages may quote user text (a grammar's rule `STOP`)."""


def sse_event(payload: BaseModel) -> str:
    """One SSE event; unset fields are left out, so a delta carries only what changed."""
    return f"data: {payload.model_dump_json(exclude_unset=True)}\n\n"


def sse_error(exc: Exception) -> str:
    """The error event of a stream that already started: the OpenAI error object as data."""
    _, body = error_response(exc)
    return f"data: {body.model_dump_json()}\n\n"


async def gather_all(
    awaitables: Iterable[Awaitable[T]],
    discard: Callable[[T], Awaitable[Any]] | None = None,
) -> list[T]:
    """`asyncio.gather`, except that one failure cancels the others (gather leaves them
    running) and hands the results already made to `discard`."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if discard is not None and not isinstance(result, BaseException):
                await discard(result)
        raise


async def gather_in_order(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Every result once all have ended, or the error of the first in order that failed: for
    short work (a request's prompts tokenized), so that the request gets the same error whichever
    failure arrives first."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return cast(list[T], results)


@dataclass(frozen=True)
class _Failed:
    error: Exception


_ENDED = object()


async def merge_streams(
    streams: Sequence[AsyncGenerator[T, None]],
) -> AsyncGenerator[tuple[int, T], None]:
    """(index, item) of every stream as items arrive. One stream failing raises here, and so
    does an abort of the request (deadline, shutdown); closing this (a client disconnect) or a
    failure closes every stream, cancelling its request."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put((index, item))
        except Exception as exc:
            await queue.put((index, _Failed(exc)))
        else:
            await queue.put((index, _ENDED))

    def abort(error: Exception) -> None:
        queue.put_nowait((-1, _Failed(error)))

    context = current_request()
    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        with context.on_abort(abort) if context is not None else nullcontext():
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is _ENDED:
                    running -= 1
                elif isinstance(item, _Failed):
                    raise item.error
                else:
                    yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class ServingLimits:
    """The server's caps on request fields; the defaults are AdapterSettings'."""

    max_n: int = AdapterSettings.model_fields["max_n"].default
    max_tokens_cap: int = AdapterSettings.model_fields["max_tokens_cap"].default

    @classmethod
    def from_settings(cls, settings: AdapterSettings) -> ServingLimits:
        return cls(max_n=settings.max_n, max_tokens_cap=settings.max_tokens_cap)


class OpenAIServing:
    """Base of the endpoint servings; subclasses name the fields behind each Triton input."""

    tensor_params: ClassVar[Mapping[str, str]]

    def __init__(
        self,
        engine: EngineClient,
        models: OpenAIServingModels,
        limits: ServingLimits | None = None,
        metrics: AdapterMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.models = models
        self.limits = limits or ServingLimits()
        self.metrics = metrics or AdapterMetrics()
        self._large_builds = asyncio.Semaphore(1)

    @staticmethod
    def check_at_most(value: int | None, limit: int, parameter: str) -> None:
        """A request field against a server limit: a 400 naming the field above it."""
        if value is not None and value > limit:
            raise InvalidRequestError(
                f"`{parameter}` must be at most {limit} (got {value}).",
                parameter=parameter,
                value=value,
            )

    def check_top_logprobs(self, info: ModelInfo, value: int | None, parameter: str) -> None:
        """A natural top-k count against the model's `max_logprobs` (docs/design.md,
        "Logprob semantics")."""
        self.check_at_most(value, info.max_logprobs, parameter)

    def check_sampling_limits(
        self, n: int | None, max_tokens: int | None, max_tokens_parameter: str
    ) -> None:
        """`n` and the token limit against the server's caps (`max_n`, `max_tokens_cap`)."""
        self.check_at_most(n, self.limits.max_n, "n")
        self.check_at_most(max_tokens, self.limits.max_tokens_cap, max_tokens_parameter)

    def default_token_limit(self, info: ModelInfo) -> int:
        """A request without its own token limit generates up to the server's cap or the
        context, whichever is smaller."""
        return min(info.max_model_len or INT32_MAX, self.limits.max_tokens_cap)

    @staticmethod
    def check_id_count(info: ModelInfo, ids: Sequence[object] | None, parameter: str) -> None:
        """An explicit id list against the model's `max_logprob_token_ids` (docs/design.md,
        "Logprob semantics")."""
        if ids is not None and len(ids) > info.max_logprob_token_ids:
            raise InvalidRequestError(
                f"`{parameter}` holds {len(ids)} ids; at most {info.max_logprob_token_ids} are "
                "allowed.",
                parameter=parameter,
            )

    @staticmethod
    def check_request_count(info: ModelInfo, count: int, parameter: str) -> None:
        """A request that makes more Triton requests than the engine can hold at once gets a
        400 naming the field: its "server busy" 503 would come back on every retry."""
        limit = info.max_requests_at_once
        if count > limit:
            raise InvalidRequestError(
                f"`{parameter}` makes {count} model requests; at most {limit} fit the model at "
                "once (its max_num_seqs + max_queue_size).",
                parameter=parameter,
                value=count,
            )

    @staticmethod
    def check_prompt_length(tokens: int, info: ModelInfo, parameter: str, prompt: str) -> None:
        """A prompt of `tokens` that leaves no room for a token to generate: `llm`'s error,
        given before any model request starts (`prompt` names it in the message)."""
        limit = info.max_model_len
        if limit is not None and tokens >= limit:
            raise InvalidRequestError(
                f"{parameter}: {prompt} has {tokens} tokens, this model's maximum context length "
                f"is {limit} tokens: at most {limit - 1} leave room for a token to generate.",
                parameter=parameter,
            )

    @contextmanager
    def field_errors(self, fields: Mapping[str, str] | None = None) -> Iterator[None]:
        """Input the model rejects becomes a 400 naming the request field behind the tensor."""
        fields = self.tensor_params if fields is None else fields
        try:
            yield
        except TritonInputError as exc:
            detail = exc.detail
            if detail.startswith(contract.NO_TOKEN_FITS):
                detail = _TENSOR_NAME.sub(
                    lambda name: f"`{fields[name[0]]}`" if name[0] in fields else name[0], detail
                )
            raise InvalidRequestError(
                f"{fields.get(exc.tensor, exc.tensor)}: {detail}",
                parameter=fields.get(exc.tensor),
            ) from exc

    async def outputs(
        self, params: TritonRequest, request_id: str, fields: Mapping[str, str] | None = None
    ) -> AsyncGenerator[TritonOutput, None]:
        """The model's responses to one request (`fields`: see `field_errors`); every Triton
        stream passes here, so its token metrics are taken here."""
        tracker = self.metrics.track_generation()
        async with aclosing(self.engine.generate(params, request_id)) as stream:
            with self.field_errors(fields):
                async for output in stream:
                    tracker.observe(output)
                    yield output

    async def collect(
        self, params: TritonRequest, request_id: str, fields: Mapping[str, str] | None = None
    ) -> list[TritonOutput]:
        """All responses of a non-streamed request, the last one final."""
        outputs = [output async for output in self.outputs(params, request_id, fields)]
        if not outputs or not outputs[-1].final:
            raise EngineError("Triton ended the stream before the final response")
        return outputs

    async def collect_all(
        self,
        choices: Sequence[TritonRequest],
        request_id: str,
        fields: Mapping[str, str] | None = None,
    ) -> list[list[TritonOutput]]:
        """Every choice's responses, all requests in flight together.

        The endpoints build the whole response from them in a worker thread: with many
        explicit ids it is large (1024 ids x 1900 tokens: about 2M logprob entries, seconds of
        Python), and on the event loop it would hold every other request, health checks
        included, for that long (an audit measured 20 s, and 8.5 min for 16 such requests).
        """
        return await gather_all(
            self.collect(params, f"{request_id}-{i}", fields) for i, params in enumerate(choices)
        )

    async def build_full_response(
        self, build: Callable[[], BaseModel], outputs: Sequence[Sequence[TritonOutput]]
    ) -> JSONBody:
        """`build()` and its JSON (pydantic-core's serializer: 0.13 s for 410k logprob entries,
        against 1.2 s for model_dump and json.dumps) in a worker thread, off the event loop
        (`collect_all`). One of `LARGE_RESPONSE_ENTRIES` or more waits until the previous such
        one is serialized, also when that one's client left, so that their memory does not
        add up."""

        def work() -> JSONBody:
            return JSONBody(build().model_dump_json())

        if _logprob_entries(outputs) < LARGE_RESPONSE_ENTRIES:
            return await asyncio.to_thread(work)
        async with self._large_builds:
            done = asyncio.ensure_future(asyncio.to_thread(work))
            try:
                return await asyncio.shield(done)
            except asyncio.CancelledError:  # the client left: the thread still holds memory
                await asyncio.wait({done})
                raise

    def request_fields(self, parameter: str) -> Mapping[str, str]:
        """`tensor_params`, with STRUCTURED_OUTPUT named by the field the request used."""
        return {**self.tensor_params, contract.STRUCTURED_OUTPUT: parameter}

    async def start_streams(
        self,
        choices: Sequence[TritonRequest],
        request_id: str,
        fields: Mapping[str, str] | None = None,
    ) -> list[AsyncGenerator[TritonOutput, None]]:
        """Every choice's stream, once each answered once (all requests in flight together).

        The model answers bad input with an error as its first response; raising it here
        makes it a plain HTTP 400 instead of an error event inside a 200 stream.
        """

        async def first(
            params: TritonRequest, choice_id: str
        ) -> tuple[TritonOutput, AsyncGenerator[TritonOutput, None]]:
            outputs = self.outputs(params, choice_id, fields)
            try:
                return await anext(outputs), outputs
            except StopAsyncIteration:
                raise EngineError("Triton ended the stream without a response") from None
            except BaseException:
                await outputs.aclose()
                raise

        async def close(started: tuple[TritonOutput, AsyncGenerator[TritonOutput, None]]) -> None:
            await started[1].aclose()

        started = await gather_all(
            (first(params, f"{request_id}-{i}") for i, params in enumerate(choices)), close
        )
        return [_prepend(output, rest) for output, rest in started]

    async def tokenize(
        self, params: TritonRequest, request_id: str, fields: Mapping[str, str] | None = None
    ) -> list[int]:
        """A text or chat prompt's ids from `preprocessing` (`fields`: see `field_errors`)."""
        with self.field_errors(fields):
            return await self.engine.tokenize(params, request_id)

    async def token_bytes(
        self, ids: Sequence[int], request_id: str, *, parameter: str
    ) -> list[bytes]:
        """Each id's bytes (special tokens' text included), `parameter` named on a bad id."""
        if not ids:
            return []
        with self.field_errors({contract.INPUT_IDS: parameter}):
            return await self.engine.token_bytes(ids, request_id)

    @staticmethod
    async def sse_stream(
        streams: Sequence[AsyncGenerator[TritonOutput, None]],
        *,
        response: type[BaseModel],
        request_id: str,
        model_name: str,
        choice: Callable[[int, TritonOutput], BaseModel | None],
        options: StreamOptions | None,
        n: int,
        lead: Sequence[BaseModel] = (),
    ) -> AsyncIterator[str]:
        """SSE lines: a `response` chunk for each `lead` choice, then one per model response
        and choice (`choice` makes the choice object; None skips the response), usage summed
        over the choices when asked, [DONE]. Under `continuous_usage_stats` the lead chunks
        carry the prompt's usage with no completion tokens yet, as in vLLM.

        An error becomes an error event. A client disconnect cancels the task iterating this
        generator; closing the merged streams then cancels the Triton requests.
        """
        created = int(time.time())

        def chunk(choices: list[BaseModel], usage: UsageInfo | None = None) -> str:
            # Chunks are serialized with exclude_unset: `object` and `usage` are set explicitly.
            return sse_event(
                response(
                    id=request_id,
                    object=response.model_fields["object"].default,
                    created=created,
                    model=model_name,
                    choices=choices,
                    **({"usage": usage} if usage is not None else {}),
                )
            )

        # vLLM's rule: per-chunk usage only together with `include_usage`.
        continuous_usage = bool(
            options and options.include_usage and options.continuous_usage_stats
        )
        finals: list[TritonOutput | None] = [None] * len(streams)
        lead_sent = not lead
        try:
            async with aclosing(merge_streams(streams)) as merged:
                async for index, output in merged:
                    if not lead_sent:  # every stream has answered: the prompt's size is known
                        lead_sent = True
                        prompt = UsageInfo.from_counts(output.prompt_tokens, 0)
                        for lead_choice in lead:
                            yield chunk([lead_choice], prompt if continuous_usage else None)
                    if output.final:
                        finals[index] = output
                    made = choice(index, output)
                    if made is None:
                        continue
                    usage = UsageInfo.from_counts(output.prompt_tokens, output.completion_tokens)
                    yield chunk([made], usage if continuous_usage else None)
            done = [final for final in finals if final is not None]
            if options is not None and options.include_usage and len(done) == len(finals):
                yield chunk([], UsageInfo.from_choices(done, n))
        except EXPECTED_ERRORS as exc:  # Triton gone, a deadline, a shutdown: no traceback
            logger.warning("stream %s ended: %s", request_id, exc)
            yield sse_error(exc)
        except Exception as exc:
            logger.exception("stream %s failed", request_id)
            yield sse_error(exc)
        yield SSE_DONE


async def _prepend(
    first: TritonOutput, rest: AsyncGenerator[TritonOutput, None]
) -> AsyncGenerator[TritonOutput, None]:
    async with aclosing(rest):
        yield first
        async for output in rest:  # after a final first response: lets the engine end the RPC
            yield output
