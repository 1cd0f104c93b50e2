"""Schemathesis against the adapter's own OpenAPI schema, in-process on a fake engine that
answers any valid request as the model would: no 5xx, and every 4xx is an OpenAI error object
(as is every error event of a stream)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from adapter.app import create_app
from adapter.errors import ErrorResponse
from adapter.settings import AdapterSettings
from tests.adapter.fakes import FakeEngine, model_script

MAX_EXAMPLES = 30
"""Generated cases per operation (9 of them), besides schemathesis's coverage cases: about
1400 requests, 10 s, on the 2-core test machine."""

APP = create_app(
    AdapterSettings(served_model_name="tiny", max_request_body_bytes=64 * 1024),
    engine=FakeEngine(respond=model_script),
)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
STATUSES: Counter[int] = Counter()


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    """One line with the cases sent and the statuses they got (shown with `pytest -s`)."""
    yield
    print(
        f"\nschema fuzz: {sum(STATUSES.values())} cases, statuses {dict(sorted(STATUSES.items()))}"
    )


def check_openai_contract(response: schemathesis.Response) -> None:
    status = response.status_code
    assert status < 500, f"{status}: {response.text[:2000]}"
    if status >= 400:
        ErrorResponse.model_validate_json(response.content)
    elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert data and data[-1] == "[DONE]", response.text[-500:]
        for payload in data[:-1]:
            event = json.loads(payload)
            if "error" in event:
                ErrorResponse.model_validate(event)


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_no_server_error_and_errors_are_openai_objects(case: schemathesis.Case) -> None:
    response = case.call()
    STATUSES[int(response.status_code)] += 1
    check_openai_contract(response)
