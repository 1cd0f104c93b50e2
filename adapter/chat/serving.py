"""POST /v1/chat/completions: messages -> a Triton stream per choice -> `chat.completion` or SSE."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
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
from adapter.context import current_request_id
from adapter.logprobs import LogprobsCollector, ShownTokens, TokenLogprob
from adapter.protocol import UsageInfo
from adapter.serving import SAMPLING_TENSOR_PARAMS, JSONBody, OpenAIServing
from adapter.tensors import TritonOutput, TritonRequest
from backend import contract

logger = logging.getLogger(__name__)


class ChatLogprobsBuilder:
    """Formats `logprobs.content` of one request, response by response."""

    def __init__(self, params: TritonRequest, *, as_token_ids: bool) -> None:
        self._collector = LogprobsCollector(params.logprob_token_ids)
        self._shown = ShownTokens(as_token_ids)
        self._logprobs = params.logprobs is not None

    def _entry(self, token: TokenLogprob) -> ChatCompletionLogProb:
        text, token_bytes = self._shown[token.token_id, token.token_bytes]
        return {"token": text, "logprob": token.logprob, "bytes": token_bytes}

    def build(self, outputs: Sequence[TritonOutput]) -> ChatCompletionLogProbs | None:
        """None when the request asked for no logprobs."""
        if not self._logprobs:
            return None
        content: list[ChatCompletionLogProbsContent] = []
        for output in outputs:
            for position in self._collector.positions(output):
                sampled = self._entry(position.sampled)
                top_logprobs = [self._entry(t) for t in position.alternatives]
                content.append({**sampled, "top_logprobs": top_logprobs})
        return ChatCompletionLogProbs.model_construct(content=content)


class OpenAIServingChat(OpenAIServing):
    """Serves /v1/chat/completions; `preprocessing` applies the chat template, then `llm`."""

    tensor_params: ClassVar[Mapping[str, str]] = {
        **SAMPLING_TENSOR_PARAMS,
        contract.MESSAGES: "messages",
        contract.ADD_GENERATION_PROMPT: "add_generation_prompt",
        contract.CONTINUE_FINAL_MESSAGE: "continue_final_message",
        contract.CHAT_TEMPLATE_KWARGS: "chat_template_kwargs",
        contract.INPUT_IDS: "messages",
        contract.LOGPROBS: "top_logprobs",
    }

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> JSONBody | AsyncIterator[str]:
        """A full response's JSON, or (stream: true) the SSE lines once every choice answered once.

        Each of the `n` choices is its own Triton request; all are in flight together.
        """
        model_name, info = await self.models.resolve(request.model)
        self.check_sampling_limits(
            request.n, request.token_limit(), request.token_limit_parameter()
        )
        self.check_top_logprobs(info, request.top_logprobs, "top_logprobs")
        self.check_id_count(info, request.logprob_token_ids, "logprob_token_ids")
        choices = request.to_generation_params(self.default_token_limit(info))
        self.check_request_count(info, len(choices), "n")
        request_id = f"chatcmpl-{current_request_id()}"
        fields = self.request_fields(request.structured_output_parameter)
        as_token_ids = bool(request.return_tokens_as_token_ids)
        builders = [ChatLogprobsBuilder(params, as_token_ids=as_token_ids) for params in choices]
        if request.stream:
            streams = await self.start_streams(choices, request_id, fields)
            return self.chat_completion_stream_generator(
                request, builders, streams, request_id, model_name
            )
        outputs = await self.collect_all(choices, request_id, fields)
        return await self.build_full_response(
            lambda: self.chat_completion_full_response(
                request, builders, outputs, request_id, model_name
            ),
            outputs,
        )

    @staticmethod
    def chat_completion_full_response(
        request: ChatCompletionRequest,
        builders: Sequence[ChatLogprobsBuilder],
        outputs: Sequence[Sequence[TritonOutput]],
        request_id: str,
        model_name: str,
    ) -> ChatCompletionResponse:
        """Each choice's responses joined into one message of the reply's role (after the echo)."""
        echo, role = request.echo_text(), request.reply_role()
        choices = [
            ChatCompletionResponseChoice(
                index=index,
                message=ChatResponseMessage(
                    role=role, content=echo + "".join(o.text for o in choice_outputs)
                ),
                logprobs=builder.build(choice_outputs),
                finish_reason=choice_outputs[-1].finish_reason,
                stop_reason=choice_outputs[-1].stop_reason,
            )
            for index, (builder, choice_outputs) in enumerate(zip(builders, outputs, strict=True))
        ]
        return ChatCompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=UsageInfo.from_choices([o[-1] for o in outputs], request.n or 1),
        )

    def chat_completion_stream_generator(
        self,
        request: ChatCompletionRequest,
        builders: Sequence[ChatLogprobsBuilder],
        streams: Sequence[AsyncGenerator[TritonOutput, None]],
        request_id: str,
        model_name: str,
    ) -> AsyncIterator[str]:
        """SSE lines: each choice's role (and echo), a delta per model response of each choice,
        the reason on each choice's last, usage summed over the choices, [DONE]."""

        def lead(delta: DeltaMessage) -> list[ChatCompletionResponseStreamChoice]:
            return [
                ChatCompletionResponseStreamChoice(
                    index=index, delta=delta, logprobs=None, finish_reason=None
                )
                for index in range(len(streams))
            ]

        def choice(index: int, output: TritonOutput) -> ChatCompletionResponseStreamChoice | None:
            if not (output.output_ids or output.text or output.final):
                return None
            # A final response without tokens closes the message with an empty delta.
            has_content = bool(output.text or output.output_ids)
            choice = ChatCompletionResponseStreamChoice(
                index=index,
                delta=DeltaMessage(content=output.text) if has_content else DeltaMessage(),
                logprobs=builders[index].build([output]),
                finish_reason=output.finish_reason if output.final else None,
            )
            if output.final:  # set, so that the chunk carries it (`sse_event`)
                choice.stop_reason = output.stop_reason
            return choice

        echo = request.echo_text()
        return self.sse_stream(
            streams,
            response=ChatCompletionStreamResponse,
            request_id=request_id,
            model_name=model_name,
            choice=choice,
            options=request.stream_options,
            n=request.n or 1,
            lead=[
                *lead(DeltaMessage(role=request.reply_role(), content="")),
                *(lead(DeltaMessage(content=echo)) if echo else []),
            ],
        )
