"""Request and response models of POST /generative_scoring (vLLM's contract, plus `labels`)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from adapter.context import REQUEST_ID_PATTERN
from adapter.errors import InvalidRequestError
from adapter.protocol import NON_EMPTY_LIST, OpenAIRequest, UsageInfo, check_token_ids


class GenerativeScoringRequest(OpenAIRequest):
    """How likely each label token is to come next after query + item, for every item.

    Each item is one `llm` request (MAX_TOKENS 1, LOGPROB_TOKEN_IDS = the label ids), all in
    flight together; a label's probability is read at the first generated position.
    """

    # vllm/entrypoints/generate/generative_scoring/serving.py `GenerativeScoringRequest`
    model: str | None = Field(default=None, description="Served model id; null: the only one.")
    query: str | list[int] = Field(description="The query text, or its token ids.")
    items: list[str] | list[list[int]] = Field(
        min_length=1,
        description="Item texts, or token-id lists; each is scored on its own.",
        json_schema_extra=NON_EMPTY_LIST,
    )
    label_token_ids: list[int] | None = Field(
        default=None, description="Token ids to score as the next token; or `labels`."
    )
    apply_softmax: bool = Field(
        default=True,
        description="Normalize over the labels (a softmax of their logprobs); false: each "
        "label's probability over the whole vocabulary.",
    )
    item_first: bool = Field(
        default=False, description="Prompt item + query instead of query + item."
    )
    add_special_tokens: bool = Field(
        default=True,
        description="Tokenize a text query with BOS etc.; text items never get them (vLLM).",
    )
    priority: int = Field(default=0, description="Accepted, not used.")
    request_id: str | None = Field(
        default=None,
        pattern=f"^{REQUEST_ID_PATTERN}$",
        description="Goes into the response `id` and the Triton request ids.",
    )

    # Our extension
    labels: list[str] | None = Field(
        default=None,
        min_length=1,
        json_schema_extra=NON_EMPTY_LIST,
        description="Label texts instead of `label_token_ids`: each must be exactly one token "
        "(tokenized without special tokens), else a 400; the response lists the ids.",
    )

    @field_validator("query", mode="before")
    @classmethod
    def _check_query(cls, value: Any) -> Any:
        return value if isinstance(value, str) else check_token_ids(value, parameter="query")

    @field_validator("items", mode="before")
    @classmethod
    def _check_items(cls, value: Any) -> Any:
        """Stable messages naming `items`, before pydantic tries the union's members."""
        if isinstance(value, list) and all(isinstance(item, list) for item in value):
            return [check_token_ids(item, parameter="items") for item in value]
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise InvalidRequestError(
                "`items` must be a list of strings or a list of token-id lists.",
                parameter="items",
            )
        return value

    @field_validator("label_token_ids", mode="before")
    @classmethod
    def _check_label_token_ids(cls, value: Any) -> Any:
        return check_token_ids(value, parameter="label_token_ids")

    @model_validator(mode="after")
    def _check_request(self) -> GenerativeScoringRequest:
        if (self.label_token_ids is None) == (self.labels is None):
            raise InvalidRequestError(
                "Send exactly one of `label_token_ids` and `labels`.", parameter="label_token_ids"
            )
        if self.label_token_ids == []:
            raise InvalidRequestError(
                "`label_token_ids` must not be empty.", parameter="label_token_ids"
            )
        if any(label == "" for label in self.labels or ()):
            raise InvalidRequestError("`labels` must not hold an empty label.", parameter="labels")
        return self


class GenerativeScoringItemResult(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float = Field(description="The first label's probability (vLLM).")
    token_probs: dict[str, float] = Field(
        description="Every label's probability (ours), keyed by its id as a string, in label order."
    )


class GenerativeScoringResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[GenerativeScoringItemResult]
    usage: UsageInfo
    label_token_ids: list[int] = Field(
        description="The ids scored (ours): `label_token_ids`, or each label's token."
    )
