"""POST /v1/chat/completions: messages -> Triton stream -> `chat.completion` or SSE chunks."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import ClassVar

from adapter.chat.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
)
from adapter.logprobs import LogprobsCollector, TokenLogprob
from adapter.protocol import UsageInfo
from adapter.serving import SAMPLING_TENSOR_PARAMS, SSE_DONE, OpenAIServing, sse_error, sse_event
from adapter.tensors import GenerationParams, TritonOutput
from backend.triton_io import INPUT_IDS, LOGPROBS, MESSAGES

logger = logging.getLogger(__name__)


class ChatLogprobsBuilder:
    """Formats `logprobs.content` of one request, response by response."""

    def __init__(self, params: GenerationParams, *, as_token_ids: bool) -> None:
        self._collector = LogprobsCollector(params.logprob_token_ids)
        self._as_token_ids = as_token_ids

    def _entry(self, token: TokenLogprob) -> ChatCompletionLogProb:
        return ChatCompletionLogProb(
            token=token.text(self._as_token_ids),
            logprob=token.logprob,
            bytes=list(token.token_bytes),
        )

    def build(self, outputs: Sequence[TritonOutput]) -> ChatCompletionLogProbs:
        content = []
        for output in outputs:
            for position in self._collector.positions(output):
                sampled = self._entry(position.sampled)
                content.append(
                    ChatCompletionLogProbsContent(
                        **sampled.model_dump(),
                        top_logprobs=[self._entry(t) for t in position.alternatives],
                    )
                )
        return ChatCompletionLogProbs(content=content)


class OpenAIServingChat(OpenAIServing):
    """Serves /v1/chat/completions; `preprocessing` applies the chat template, then `llm`."""

    tensor_params: ClassVar[Mapping[str, str]] = {
        **SAMPLING_TENSOR_PARAMS,
        MESSAGES: "messages",
        INPUT_IDS: "messages",
        LOGPROBS: "top_logprobs",
    }

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """A full response, or (stream: true) the SSE lines once the model answered once."""
        model_name, info = await self.models.resolve(request.model)
        self.check_limits(
            info,
            top_logprobs=request.top_logprobs,
            top_logprobs_param="top_logprobs",
            logprob_token_ids=request.logprob_token_ids,
        )
        params = request.to_generation_params(info.max_model_len)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if request.stream:
            outputs = await self.start_stream(params, request_id)
            return self.chat_completion_stream_generator(
                request, params, outputs, request_id, model_name
            )
        outputs_list = await self.collect(params, request_id)
        return self.chat_completion_full_response(
            request, params, outputs_list, request_id, model_name
        )

    @staticmethod
    def chat_completion_full_response(
        request: ChatCompletionRequest,
        params: GenerationParams,
        outputs: Sequence[TritonOutput],
        request_id: str,
        model_name: str,
    ) -> ChatCompletionResponse:
        """All responses of the model joined into one assistant message."""
        builder = ChatLogprobsBuilder(params, as_token_ids=bool(request.return_tokens_as_token_ids))
        last = outputs[-1]
        return ChatCompletionResponse(
            id=request_id,
            model=model_name,
            choices=[
                ChatCompletionResponseChoice(
                    index=0,
                    message=ChatResponseMessage(content="".join(o.text for o in outputs)),
                    logprobs=None if params.logprobs is None else builder.build(outputs),
                    finish_reason=last.finish_reason,
                )
            ],
            usage=UsageInfo.from_counts(last.prompt_tokens, last.completion_tokens),
        )

    @staticmethod
    async def chat_completion_stream_generator(
        request: ChatCompletionRequest,
        params: GenerationParams,
        outputs: AsyncGenerator[TritonOutput, None],
        request_id: str,
        model_name: str,
    ) -> AsyncIterator[str]:
        """SSE lines: the role, a delta per model response, the reason on the last, usage, [DONE].

        A client disconnect cancels the task iterating this generator; closing `outputs`
        then cancels the Triton request.
        """
        created = int(time.time())
        builder = ChatLogprobsBuilder(params, as_token_ids=bool(request.return_tokens_as_token_ids))
        options = request.stream_options
        continuous_usage = bool(options and options.continuous_usage_stats)

        def chunk(
            choices: list[ChatCompletionResponseStreamChoice], usage: UsageInfo | None = None
        ) -> str:
            return sse_event(
                ChatCompletionStreamResponse(
                    id=request_id,
                    object="chat.completion.chunk",
                    created=created,
                    model=model_name,
                    choices=choices,
                    **({"usage": usage} if usage is not None else {}),
                )
            )

        last: TritonOutput | None = None
        try:
            yield chunk(
                [
                    ChatCompletionResponseStreamChoice(
                        index=0,
                        delta=DeltaMessage(role="assistant", content=""),
                        logprobs=None,
                        finish_reason=None,
                    )
                ]
            )
            async with aclosing(outputs):
                async for output in outputs:
                    last = output
                    if not (output.output_ids or output.text or output.final):
                        continue
                    # A final response without tokens closes the message with an empty delta.
                    has_content = bool(output.text or output.output_ids)
                    delta = DeltaMessage(content=output.text) if has_content else DeltaMessage()
                    choice = ChatCompletionResponseStreamChoice(
                        index=0,
                        delta=delta,
                        logprobs=None if params.logprobs is None else builder.build([output]),
                        finish_reason=output.finish_reason if output.final else None,
                    )
                    usage = UsageInfo.from_counts(output.prompt_tokens, output.completion_tokens)
                    yield chunk([choice], usage if continuous_usage else None)
            if last is not None and options is not None and options.include_usage:
                yield chunk([], UsageInfo.from_counts(last.prompt_tokens, last.completion_tokens))
        except Exception as exc:
            logger.exception("chat stream %s failed", request_id)
            yield sse_error(exc)
        yield SSE_DONE
