"""/generative_scoring against a fake engine: prompts built, label logprobs -> probabilities."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from adapter.errors import TritonInputError
from adapter.scoring.serving import label_probabilities
from adapter.tensors import TritonRequest
from backend import contract
from tests.adapter.fakes import FakeEngine, Script, output

URL = "/generative_scoring"
LOGPROBS = {(5, 6, 7): [-0.5, -1.5], (5, 6, 8, 9): [-3.0, -9999.0]}  # per prompt, ids 20, 30


def scored(params: TritonRequest) -> Script:
    """One generated token with the label ids' logprobs for the prompt."""
    row = LOGPROBS[params.prompt_ids or ()]
    ids = params.logprob_token_ids
    return [
        output(
            tokens=[(1, b"x", -0.1)],
            requested=[row[: len(ids)]],
            requested_bytes=[b"l"] * len(ids),
            finish_reason="length",
            prompt_tokens=len(params.prompt_ids or ()),
            completion_tokens=1,
        )
    ]


@pytest.fixture(autouse=True)
def _scoring_engine(engine: FakeEngine) -> None:
    engine.respond = scored
    engine.tokens = {
        "Q": [5, 6],
        "a": [7],
        "bc": [8, 9],
        "Yes": [20],
        "No": [30],
        "Maybe": [40, 41],
    }


def test_softmax_over_the_labels(engine: FakeEngine, client: TestClient) -> None:
    body = {"model": "tiny", "query": "Q", "items": ["a", "bc"], "label_token_ids": [20, 30]}
    response = client.post(URL, json={**body, "request_id": "trace-1.a:b"})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["id"] == "generative-scoring-trace-1.a:b"
    assert result["object"] == "list"
    assert result["label_token_ids"] == [20, 30]
    first, second = result["data"]
    p = 1 / (1 + math.exp(-1.0))
    assert first["index"] == 0 and first["object"] == "score"
    assert first["score"] == pytest.approx(p)
    assert first["token_probs"] == pytest.approx({"20": p, "30": 1 - p})
    assert second["token_probs"] == {"20": 1.0, "30": 0.0}  # -9999 is -inf
    assert result["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    sent = [params for params, _ in engine.requests]
    assert {(p.max_tokens, p.temperature, p.logprobs, p.logprob_token_ids) for p in sent} == {
        (1, 0.0, 0, (20, 30))
    }
    query, *items = engine.tokenized
    assert (query.text, query.add_special_tokens) == ("Q", True)
    assert [(i.text, i.add_special_tokens) for i in items] == [("a", False), ("bc", False)]


def test_raw_probabilities_item_first_and_token_ids(client: TestClient) -> None:
    body = {
        "query": [8, 9],
        "items": [[5, 6]],
        "item_first": True,
        "label_token_ids": [20],
        "apply_softmax": False,
    }
    [item] = client.post(URL, json=body).json()["data"]
    assert item["token_probs"] == pytest.approx({"20": math.exp(-3.0)})  # prompt [5, 6, 8, 9]


def test_labels_score_their_tokens(engine: FakeEngine, client: TestClient) -> None:
    body = {"query": "Q", "items": ["a"], "labels": ["Yes", "No"]}
    result = client.post(URL, json=body).json()
    assert result["label_token_ids"] == [20, 30]
    assert result["data"][0]["token_probs"].keys() == {"20", "30"}
    labels = [p for p in engine.tokenized if p.text in ("Yes", "No")]
    assert all(p.add_special_tokens is False for p in labels)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"query": "Q", "items": ["a"]}, "label_token_ids", "exactly one of"),
        (
            {"query": "Q", "items": ["a"], "labels": ["No"], "label_token_ids": [1]},
            "label_token_ids",
            "exactly one of",
        ),
        ({"query": "Q", "items": ["a"], "label_token_ids": []}, "label_token_ids", "empty"),
        ({"query": "Q", "items": [], "label_token_ids": [1]}, "items", "at least 1 item"),
        ({"query": "Q", "items": ["a", [1]], "label_token_ids": [1]}, "items", "a list of"),
        ({"query": "Q", "items": [[1, "x"]], "label_token_ids": [1]}, "items", "integer"),
        ({"query": [1.5], "items": ["a"], "label_token_ids": [1]}, "query", "integer"),
        ({"query": "Q", "items": ["a"], "labels": [""]}, "labels", "an empty label"),
        ({"query": "Q", "items": ["a"], "labels": ["Yes", "Yes"]}, "labels", "both token 20"),
        (
            {"query": "Q", "items": ["a"], "labels": ["Yes", "Maybe"]},
            "labels",
            "'Maybe' is 2 tokens [40, 41], not one",
        ),
        ({"query": "Q", "items": ["a"], "label_token_ids": list(range(9))}, "label_token_ids", "8"),
        # as X-Request-Id: nothing that could forge a log line or a Triton id
        (
            {"query": "Q", "items": ["a"], "label_token_ids": [1], "request_id": "x\nCRITICAL"},
            "request_id",
            "String should match pattern",
        ),
        (
            {"query": "Q", "items": ["a"], "labels": ["No"], "request_id": "a" * 129},
            "request_id",
            "",
        ),
    ],
)
def test_bad_requests_name_the_field(
    client: TestClient, body: dict, param: str, message: str
) -> None:
    response = client.post(URL, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert message in response.json()["error"]["message"]


def test_the_query_s_faults_name_the_query(engine: FakeEngine, client: TestClient) -> None:
    """Every item's prompt holds the query: the model's error would name `items`."""
    body = {"query": [5, 6], "items": ["a"], "label_token_ids": [20]}
    assert client.post(URL, json=body).status_code == 200
    assert engine.detokenized == [(5, 6)]  # the token-id query's ids checked, once
    engine.bytes_error = TritonInputError(contract.INPUT_IDS, "id 99999 is outside the vocabulary")
    engine.tokens["Q" * 64] = [5] * 64
    for query, message in [
        ([5, 99999], "query: id 99999 is outside the vocabulary"),
        (
            "Q" * 64,
            "query: the query has 64 tokens, this model's maximum context length is 64 tokens: "
            "at most 63 leave",
        ),
    ]:
        response = client.post(URL, json={**body, "query": query})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "query"
        assert response.json()["error"]["message"].startswith(message)


def test_an_item_s_fault_names_the_item(engine: FakeEngine, client: TestClient) -> None:
    """The model's error about one item's prompt says which item, as `items[i]`."""
    too_long = TritonInputError(contract.INPUT_IDS, "the prompt has 70 tokens")
    engine.respond = lambda p: [too_long] if p.prompt_ids == (5, 6, 8, 9) else scored(p)
    body = {"query": "Q", "items": ["a", "bc"], "label_token_ids": [20]}
    error = client.post(URL, json=body).json()["error"]
    assert (error["param"], error["message"]) == ("items[1]", "items[1]: the prompt has 70 tokens")


def test_an_empty_query_and_item_is_a_400_naming_the_item(
    engine: FakeEngine, client: TestClient
) -> None:
    """Before any model request: the model's message would speak of its inputs."""
    body = {"query": [], "items": [[7], []], "label_token_ids": [20]}
    error = client.post(URL, json=body).json()["error"]
    assert (error["param"], error["message"]) == (
        "items[1]",
        "items[1]: the query and the item hold no token ids together.",
    )
    assert engine.requests == []


def test_more_items_than_the_engine_holds_are_400(engine: FakeEngine, client: TestClient) -> None:
    """A "server busy" 503 would come back on every retry."""
    engine.info = replace(engine.info, max_num_seqs=1, max_queue_size=1)
    body = {"query": "Q", "items": ["a", "bc", "a"], "label_token_ids": [20, 30]}
    response = client.post(URL, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "items"
    assert error["message"].startswith("`items` makes 3 model requests; at most 2 fit")
    assert (engine.requests, engine.tokenized) == ([], [])
    assert client.post(URL, json={**body, "items": ["a", "bc"]}).status_code == 200


def test_label_probabilities() -> None:
    assert label_probabilities([0.0, 0.0], apply_softmax=True) == [0.5, 0.5]
    assert label_probabilities([-1000.0, -1001.0], apply_softmax=True) == pytest.approx(
        [1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))]  # stable far from 0
    )
    assert label_probabilities([math.log(0.25)], apply_softmax=False) == pytest.approx([0.25])
