"""POST /v1/completions: request -> Triton stream -> `text_completion` response or SSE chunks."""

from __future__ import annotations

import codecs
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import ClassVar

from adapter.completions.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from adapter.logprobs import LogprobsCollector
from adapter.protocol import UsageInfo
from adapter.serving import SAMPLING_TENSOR_PARAMS, SSE_DONE, OpenAIServing, sse_error, sse_event
from adapter.tensors import GenerationParams, TritonOutput
from backend.triton_io import INPUT_IDS, LOGPROBS, TEXT_INPUT

logger = logging.getLogger(__name__)


class CompletionLogprobsBuilder:
    """Formats the `logprobs` of one request, response by response.

    `text_offset` is each token's character offset in the generated text, counted by decoding
    the tokens' bytes incrementally, so it keeps running across chunks; a token that only
    starts a multi-byte character gets that character's offset.
    """

    def __init__(self, params: GenerationParams, *, as_token_ids: bool) -> None:
        self._collector = LogprobsCollector(params.logprob_token_ids)
        self._as_token_ids = as_token_ids
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0

    def build(self, outputs: Sequence[TritonOutput]) -> CompletionLogProbs:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        text_offset: list[int] = []
        top_logprobs: list[dict[str, float] | None] = []
        for output in outputs:
            for position in self._collector.positions(output):
                sampled = position.sampled
                tokens.append(sampled.text(self._as_token_ids))
                token_logprobs.append(sampled.logprob)
                text_offset.append(self._offset)
                self._offset += len(self._decoder.decode(sampled.token_bytes))
                # OpenAI and vLLM always put the sampled token in the dict (up to logprobs + 1
                # entries); with explicit ids the alternatives already start with it.
                entries = (
                    position.alternatives
                    if position.explicit
                    else (sampled, *position.alternatives)
                )
                top: dict[str, float] = {}
                for entry in entries:
                    top.setdefault(entry.text(self._as_token_ids), entry.logprob)
                top_logprobs.append(top)
        # Every field passed explicitly: stream chunks are serialized with exclude_unset.
        return CompletionLogProbs(
            text_offset=text_offset,
            token_logprobs=token_logprobs,
            tokens=tokens,
            top_logprobs=top_logprobs,
        )


class OpenAIServingCompletion(OpenAIServing):
    """Serves /v1/completions: text prompts are tokenized by `preprocessing`, then `llm`."""

    tensor_params: ClassVar[Mapping[str, str]] = {
        **SAMPLING_TENSOR_PARAMS,
        INPUT_IDS: "prompt",
        TEXT_INPUT: "prompt",
        LOGPROBS: "logprobs",
    }

    async def create_completion(
        self, request: CompletionRequest
    ) -> CompletionResponse | AsyncIterator[str]:
        """A full response, or (stream: true) the SSE lines once the model answered once."""
        model_name, info = await self.models.resolve(request.model)
        self.check_limits(
            info,
            top_logprobs=request.logprobs,
            top_logprobs_param="logprobs",
            logprob_token_ids=request.logprob_token_ids,
        )
        params = request.to_generation_params()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if request.stream:
            outputs = await self.start_stream(params, request_id)
            return self.completion_stream_generator(
                request, params, outputs, request_id, model_name
            )
        outputs_list = await self.collect(params, request_id)
        return self.completion_full_response(request, params, outputs_list, request_id, model_name)

    @staticmethod
    def completion_full_response(
        request: CompletionRequest,
        params: GenerationParams,
        outputs: Sequence[TritonOutput],
        request_id: str,
        model_name: str,
    ) -> CompletionResponse:
        """All responses of the model joined into one choice."""
        builder = CompletionLogprobsBuilder(
            params, as_token_ids=bool(request.return_tokens_as_token_ids)
        )
        last = outputs[-1]
        return CompletionResponse(
            id=request_id,
            model=model_name,
            choices=[
                CompletionResponseChoice(
                    index=0,
                    text="".join(output.text for output in outputs),
                    logprobs=None if params.logprobs is None else builder.build(outputs),
                    finish_reason=last.finish_reason,
                )
            ],
            usage=UsageInfo.from_counts(last.prompt_tokens, last.completion_tokens),
        )

    @staticmethod
    async def completion_stream_generator(
        request: CompletionRequest,
        params: GenerationParams,
        outputs: AsyncGenerator[TritonOutput, None],
        request_id: str,
        model_name: str,
    ) -> AsyncIterator[str]:
        """SSE lines: a chunk per model response, the reason on the last, usage, [DONE].

        A client disconnect cancels the task iterating this generator; closing `outputs`
        then cancels the Triton request.
        """
        created = int(time.time())
        builder = CompletionLogprobsBuilder(
            params, as_token_ids=bool(request.return_tokens_as_token_ids)
        )
        options = request.stream_options
        continuous_usage = bool(options and options.continuous_usage_stats)
        last: TritonOutput | None = None
        try:
            async with aclosing(outputs):
                async for output in outputs:
                    last = output
                    if not (output.output_ids or output.text or output.final):
                        continue
                    choice = CompletionResponseStreamChoice(
                        index=0,
                        text=output.text,
                        logprobs=None if params.logprobs is None else builder.build([output]),
                        finish_reason=output.finish_reason if output.final else None,
                    )
                    usage = UsageInfo.from_counts(output.prompt_tokens, output.completion_tokens)
                    yield sse_event(
                        CompletionStreamResponse(
                            id=request_id,
                            object="text_completion",
                            created=created,
                            model=model_name,
                            choices=[choice],
                            **({"usage": usage} if continuous_usage else {}),
                        )
                    )
            if last is not None and options is not None and options.include_usage:
                yield sse_event(
                    CompletionStreamResponse(
                        id=request_id,
                        object="text_completion",
                        created=created,
                        model=model_name,
                        choices=[],
                        usage=UsageInfo.from_counts(last.prompt_tokens, last.completion_tokens),
                    )
                )
        except Exception as exc:
            logger.exception("completion stream %s failed", request_id)
            yield sse_error(exc)
        yield SSE_DONE
