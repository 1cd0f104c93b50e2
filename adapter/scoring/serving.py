"""POST /generative_scoring: query + each item -> one `llm` step -> the labels' probabilities."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

from adapter.context import current_request_id
from adapter.engine_client import ModelInfo
from adapter.errors import EngineError, InvalidRequestError
from adapter.protocol import UsageInfo, distinct
from adapter.scoring.protocol import (
    GenerativeScoringItemResult,
    GenerativeScoringRequest,
    GenerativeScoringResponse,
)
from adapter.serving import OpenAIServing, gather_all, gather_in_order
from adapter.tensors import TritonRequest
from backend import contract


def label_probabilities(logprobs: Sequence[float], apply_softmax: bool) -> list[float]:
    """A softmax over the labels' logprobs, or each one's probability over the vocabulary."""
    if not apply_softmax:
        return [math.exp(logprob) for logprob in logprobs]
    top = max(logprobs)
    weights = [math.exp(logprob - top) for logprob in logprobs]
    total = sum(weights)
    return [weight / total for weight in weights]


class OpenAIServingGenerativeScoring(OpenAIServing):
    """Tokenizes the query, the items and the labels with `preprocessing`, then scores each
    item with one `llm` request; every request of a kind is in flight together."""

    tensor_params: ClassVar[Mapping[str, str]] = {
        contract.TEXT_INPUT: "query",
        contract.INPUT_IDS: "items",
        contract.LOGPROB_TOKEN_IDS: "label_token_ids",
    }

    async def create_generative_scoring(
        self, request: GenerativeScoringRequest
    ) -> GenerativeScoringResponse:
        model_name, info = await self.models.resolve(request.model)
        self.check_request_count(info, len(request.items), "items")
        label_param = "label_token_ids" if request.labels is None else "labels"
        self.check_id_count(info, request.label_token_ids or request.labels, label_param)
        request_id = f"generative-scoring-{request.request_id or current_request_id()}"
        label_ids = request.label_token_ids or await self._label_tokens(
            request.labels or [], request_id
        )
        query, *items = await gather_in_order(
            [
                self._ids(
                    request.query, request.add_special_tokens, f"{request_id}-query", "query"
                ),
                *(
                    self._ids(item, False, f"{request_id}-item-{i}", f"items[{i}]")  # type: ignore[arg-type]  # pydantic gives each item as str or list[int]
                    for i, item in enumerate(request.items)
                ),
            ]
        )
        await self._check_query(request.query, query, info, request_id)
        scored = distinct(label_ids)
        choices = [
            TritonRequest(
                prompt_ids=tuple(item + query if request.item_first else query + item),
                max_tokens=1,
                temperature=0.0,
                logprobs=0,
                logprob_token_ids=scored,
            )
            for item in items
        ]
        for i, params in enumerate(choices):
            if not params.prompt_ids:  # the model's own message would name its inputs
                raise InvalidRequestError(
                    f"items[{i}]: the query and the item hold no token ids together.",
                    parameter=f"items[{i}]",
                )
        fields = {**self.tensor_params, contract.LOGPROB_TOKEN_IDS: label_param}
        # An item's own fault (its prompt too long, an id outside the vocabulary) names it.
        outputs = await gather_all(
            self.collect(params, f"{request_id}-{i}", {**fields, contract.INPUT_IDS: f"items[{i}]"})
            for i, params in enumerate(choices)
        )
        data = []
        for index, item_outputs in enumerate(outputs):
            rows = item_outputs[0].requested_logprobs
            if len(rows) != 1 or len(rows[0]) != len(scored):
                raise EngineError(f"Triton sent no logprobs of the labels for item {index}")
            probabilities = label_probabilities(rows[0], request.apply_softmax)
            token_probs = {str(t): p for t, p in zip(scored, probabilities, strict=True)}
            data.append(
                GenerativeScoringItemResult(
                    index=index, score=token_probs[str(label_ids[0])], token_probs=token_probs
                )
            )
        return GenerativeScoringResponse(
            id=request_id,
            model=model_name,
            data=data,
            usage=UsageInfo.from_choices([o[-1] for o in outputs], 1),
            label_token_ids=list(label_ids),
        )

    async def _ids(
        self, value: str | list[int], add_special_tokens: bool, request_id: str, parameter: str
    ) -> list[int]:
        """A text's ids from `preprocessing`; ids as they are."""
        if not isinstance(value, str):
            return value
        params = TritonRequest(text=value, add_special_tokens=add_special_tokens)
        return await self.tokenize(params, request_id, {contract.TEXT_INPUT: parameter})

    async def _check_query(
        self, given: str | list[int], ids: list[int], info: ModelInfo, request_id: str
    ) -> None:
        """The query's own faults, named `query`: every item's prompt holds it, and the model's
        errors about a prompt name the item (`items[i]`)."""
        if not isinstance(given, str):  # its ids against the vocabulary, by `preprocessing`
            await self.token_bytes(ids, f"{request_id}-query-ids", parameter="query")
        self.check_prompt_length(len(ids), info, "query", "the query")

    async def _label_tokens(self, labels: Sequence[str], request_id: str) -> list[int]:
        """Each label's token. A label of several tokens is refused: its first token alone
        (the space before " yes", say) would score something else; two labels of one token
        could not be told apart."""
        tokenized = await gather_in_order(
            self._ids(label, False, f"{request_id}-label-{i}", "labels")
            for i, label in enumerate(labels)
        )
        token_of: dict[int, str] = {}
        for label, ids in zip(labels, tokenized, strict=True):
            if len(ids) != 1:
                raise InvalidRequestError(
                    f"`labels`: {label!r} is {len(ids)} tokens {list(ids)}, not one; score "
                    "chosen ids with `label_token_ids`.",
                    parameter="labels",
                )
            if ids[0] in token_of:
                raise InvalidRequestError(
                    f"`labels` {token_of[ids[0]]!r} and {label!r} are both token {ids[0]}.",
                    parameter="labels",
                )
            token_of[ids[0]] = label
        return list(token_of)
