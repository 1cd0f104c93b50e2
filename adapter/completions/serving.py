"""POST /v1/completions: request -> a Triton stream per choice -> `text_completion` or SSE."""

from __future__ import annotations

import codecs
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from adapter.completions.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from adapter.context import current_request_id
from adapter.engine_client import ModelInfo
from adapter.errors import EngineError
from adapter.logprobs import (
    LogprobsCollector,
    PositionLogprobs,
    ShownTokens,
    TokenLogprob,
    token_text,
)
from adapter.protocol import UsageInfo
from adapter.serving import (
    SAMPLING_TENSOR_PARAMS,
    JSONBody,
    OpenAIServing,
    gather_in_order,
)
from adapter.tensors import TritonOutput, TritonRequest
from backend import contract

logger = logging.getLogger(__name__)


@dataclass
class _LogprobLists:
    text_offset: list[int] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)


class CompletionChoiceBuilder:
    """Formats the text and `logprobs` of one choice, response by response.

    With `echo` the prompt comes first: the request's text, or for a token-id prompt its
    tokens' bytes decoded; with `logprobs` also its tokens, the first with null logprob and
    `top_logprobs`. `text_offset` is each token's character offset in the choice's text,
    counted by decoding the tokens' bytes incrementally, so it keeps running across chunks; a
    token that only starts a multi-byte character gets that character's offset. An echoed text
    prompt need not be its tokens' bytes (a BOS, SentencePiece's leading space): its tokens'
    offsets stop at its end, and the generated tokens' start there.
    """

    def __init__(self, request: CompletionRequest, params: TritonRequest) -> None:
        self._collector = LogprobsCollector(
            params.logprob_token_ids, params.prompt_logprob_token_ids
        )
        self._as_token_ids = bool(request.return_tokens_as_token_ids)
        self._logprobs = params.logprobs is not None
        self._echo_pending = bool(request.echo)
        self._prompt_text = params.text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0
        self._shown = ShownTokens(self._as_token_ids)

    def build(self, outputs: Sequence[TritonOutput]) -> tuple[str, CompletionLogProbs | None]:
        text = ""
        lists = _LogprobLists()
        for output in outputs:
            if self._echo_pending:
                self._echo_pending = False
                text += self._echo(output, lists)
            text += output.text
            if self._logprobs:
                for position in self._collector.positions(output):
                    self._add(lists, position)
        if not self._logprobs:
            return text, None
        # Every field passed explicitly: stream chunks are serialized with exclude_unset.
        return text, CompletionLogProbs(
            text_offset=lists.text_offset,
            token_logprobs=lists.token_logprobs,
            tokens=lists.tokens,
            top_logprobs=lists.top_logprobs,
        )

    def _echo(self, output: TritonOutput, lists: _LogprobLists) -> str:
        """The prompt's text, and with logprobs its positions (from the first response)."""
        prompt = output.prompt
        if prompt is None:
            if self._prompt_text is None or self._logprobs:
                raise EngineError("Triton sent no prompt tokens for `echo`")
            return self._prompt_text
        if self._logprobs:
            self._add_token(lists, prompt.ids[0], prompt.token_bytes[0], None, None)
            for position in self._collector.prompt_positions(prompt):
                self._add(lists, position)
        if self._prompt_text is not None:
            end = len(self._prompt_text)
            lists.text_offset[:] = [min(offset, end) for offset in lists.text_offset]
            self._offset = end
            self._decoder.reset()
            return self._prompt_text
        return b"".join(prompt.token_bytes).decode("utf-8", errors="replace")

    def _add(self, lists: _LogprobLists, position: PositionLogprobs) -> None:
        sampled = position.sampled
        # OpenAI and vLLM always put the sampled token in the dict (up to logprobs + 1
        # entries); with explicit ids the alternatives already start with it.
        entries = position.alternatives if position.explicit else (sampled, *position.alternatives)
        self._add_token(lists, sampled.token_id, sampled.token_bytes, sampled.logprob, entries)

    def _add_token(
        self,
        lists: _LogprobLists,
        token_id: int,
        token_bytes: bytes,
        logprob: float | None,
        entries: Sequence[TokenLogprob] | None,
    ) -> None:
        lists.tokens.append(token_text(token_id, token_bytes, self._as_token_ids))
        lists.token_logprobs.append(logprob)
        lists.text_offset.append(self._offset)
        self._offset += len(self._decoder.decode(token_bytes))
        top: dict[str, float] | None = None
        if entries is not None:
            top = {}
            for entry in entries:
                top.setdefault(self._shown[entry.token_id, entry.token_bytes][0], entry.logprob)
        lists.top_logprobs.append(top)


class OpenAIServingCompletion(OpenAIServing):
    """Serves /v1/completions: text prompts are tokenized by `preprocessing`, then `llm`."""

    tensor_params: ClassVar[Mapping[str, str]] = {
        **SAMPLING_TENSOR_PARAMS,
        contract.INPUT_IDS: "prompt",
        contract.TEXT_INPUT: "prompt",
        contract.LOGPROBS: "logprobs",
        contract.PROMPT_LOGPROBS: "logprobs",
        contract.PROMPT_LOGPROB_TOKEN_IDS: "prompt_logprob_token_ids",
    }

    async def create_completion(self, request: CompletionRequest) -> JSONBody | AsyncIterator[str]:
        """A full response, or (stream: true) the SSE lines once every choice answered once.

        Each choice (`n` per prompt) is its own Triton request; all are in flight together.
        """
        model_name, info = await self.models.resolve(request.model)
        self.check_sampling_limits(request.n, request.max_tokens, "max_tokens")
        self.check_top_logprobs(info, request.logprobs, "logprobs")
        self.check_id_count(info, request.logprob_token_ids, "logprob_token_ids")
        self.check_id_count(info, request.prompt_logprob_token_ids, "prompt_logprob_token_ids")
        choices = request.to_generation_params(self.default_token_limit(info))
        batch = len(choices) > (request.n or 1)
        self.check_request_count(info, len(choices), "prompt" if batch else "n")
        request_id = f"cmpl-{current_request_id()}"
        if batch:
            choices = await self._tokenized(choices, request.n or 1, info, request_id)
        fields = self.request_fields(request.structured_output_parameter)
        builders = [CompletionChoiceBuilder(request, params) for params in choices]
        if request.stream:
            streams = await self.start_streams(choices, request_id, fields)
            return self.completion_stream_generator(
                request, builders, streams, request_id, model_name
            )
        outputs = await self.collect_all(choices, request_id, fields)
        return await self.build_full_response(
            lambda: self.completion_full_response(
                request, builders, outputs, request_id, model_name
            ),
            outputs,
        )

    async def _tokenized(
        self, choices: Sequence[TritonRequest], n: int, info: ModelInfo, request_id: str
    ) -> list[TritonRequest]:
        """Several prompts (`n` choices each): each one's ids, checked against the context
        before any of them runs, so that one too long refuses the request, naming its index,
        before the others generate (vLLM checks every prompt first); of several refused, the
        first. A text prompt keeps its text, for `echo`."""
        texts = {c.text: c for c in choices if c.needs_tokenizing and c.text is not None}
        tokenized = await gather_in_order(
            self.tokenize(params, f"{request_id}-prompt-{i}", self.tensor_params)
            for i, params in enumerate(texts.values())
        )
        ids_of = dict(zip(texts, tokenized, strict=True))
        checked = []
        for index, params in enumerate(choices):
            ids = params.prompt_ids if params.text is None else tuple(ids_of[params.text])
            assert ids is not None  # a prompt is a text or ids (`CompletionRequest.prompts`)
            self.check_prompt_length(len(ids), info, "prompt", f"the prompt at index {index // n}")
            params.check_fits_context(len(ids), info.max_model_len)
            checked.append(replace(params, prompt_ids=ids))
        return checked

    @staticmethod
    def completion_full_response(
        request: CompletionRequest,
        builders: Sequence[CompletionChoiceBuilder],
        outputs: Sequence[Sequence[TritonOutput]],
        request_id: str,
        model_name: str,
    ) -> CompletionResponse:
        """Each choice's responses joined into one choice."""
        choices = []
        for index, (builder, choice_outputs) in enumerate(zip(builders, outputs, strict=True)):
            text, logprobs = builder.build(choice_outputs)
            choices.append(
                CompletionResponseChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=choice_outputs[-1].finish_reason,
                    stop_reason=choice_outputs[-1].stop_reason,
                )
            )
        return CompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=UsageInfo.from_choices([o[-1] for o in outputs], request.n or 1),
        )

    def completion_stream_generator(
        self,
        request: CompletionRequest,
        builders: Sequence[CompletionChoiceBuilder],
        streams: Sequence[AsyncGenerator[TritonOutput, None]],
        request_id: str,
        model_name: str,
    ) -> AsyncIterator[str]:
        """SSE lines: a chunk per model response of each choice (its `index` set), the reason
        on each choice's last, usage summed over the choices, [DONE]."""

        def choice(index: int, output: TritonOutput) -> CompletionResponseStreamChoice | None:
            if not (output.output_ids or output.text or output.final):
                return None
            text, logprobs = builders[index].build([output])
            return CompletionResponseStreamChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=output.finish_reason if output.final else None,
                stop_reason=output.stop_reason if output.final else None,  # vLLM: every chunk
            )

        return self.sse_stream(
            streams,
            response=CompletionStreamResponse,
            request_id=request_id,
            model_name=model_name,
            choice=choice,
            options=request.stream_options,
            n=request.n or 1,
        )
