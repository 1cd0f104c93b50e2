"""/generative_scoring through the real adapter and tritonserver, against the float64
reference."""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest

from tests.integration.openai_support import (
    ATOL,
    MODEL,
    reference_next_logprobs,
    text_prompt_ids,
)
from tests.reference import tokenizer

QUERY = "Triton serves the"
ITEMS = [" model and", " model", " cat"]
LABELS = [302, 260, 17, 1010]  # any ids, one from the padded vocabulary


def item_ids(model_dir, item: str) -> list[int]:
    return tokenizer(model_dir)(item, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("apply_softmax", [True, False])
def test_scores_equal_the_reference(http: httpx.Client, model_dir, apply_softmax: bool) -> None:
    body = {
        "model": MODEL,
        "query": QUERY,
        "items": ITEMS,
        "label_token_ids": LABELS,
        "apply_softmax": apply_softmax,
    }
    response = http.post("/generative_scoring", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert (result["object"], result["model"], result["label_token_ids"]) == (
        "list",
        MODEL,
        LABELS,
    )
    query = text_prompt_ids(model_dir, QUERY)
    prompt_tokens = 0
    for index, (entry, item) in enumerate(zip(result["data"], ITEMS, strict=True)):
        prompt = query + item_ids(model_dir, item)
        prompt_tokens += len(prompt)
        ref = reference_next_logprobs(model_dir, prompt)[LABELS]
        expected = np.exp(ref - ref.max()) / np.exp(ref - ref.max()).sum()
        if not apply_softmax:
            expected = np.exp(ref)
        assert (entry["index"], entry["object"]) == (index, "score")
        assert list(entry["token_probs"]) == [str(t) for t in LABELS]
        assert np.allclose(list(entry["token_probs"].values()), expected, atol=ATOL)
        assert entry["score"] == entry["token_probs"][str(LABELS[0])]
        if apply_softmax:
            assert math.isclose(sum(entry["token_probs"].values()), 1.0, abs_tol=1e-9)
    assert result["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(ITEMS),
        "total_tokens": prompt_tokens + len(ITEMS),
    }


def test_labels_item_first_and_token_prompts(http: httpx.Client, model_dir) -> None:
    query = text_prompt_ids(model_dir, " serves the model")
    items = [text_prompt_ids(model_dir, "Triton"), text_prompt_ids(model_dir, "A cat")]
    texts = [" ", "x"]  # one token each in the test model's small vocabulary
    body = {"query": query, "items": items, "labels": texts, "item_first": True}
    result = http.post("/generative_scoring", json=body).json()
    labels = [token for label in texts for token in item_ids(model_dir, label)]
    assert result["label_token_ids"] == labels and len(labels) == len(texts)
    for entry, item in zip(result["data"], items, strict=True):
        ref = reference_next_logprobs(model_dir, item + query)[labels]
        expected = np.exp(ref) / np.exp(ref).sum()
        assert np.allclose(list(entry["token_probs"].values()), expected, atol=ATOL)
    # The memorised passage goes on with " and" (" " first) after "Triton serves the model".
    assert result["data"][0]["score"] > 0.99
