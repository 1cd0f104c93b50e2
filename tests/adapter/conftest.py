"""Fixtures of the adapter's unit tests: the app on a fake engine, through Starlette's client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from adapter.app import create_app
from adapter.settings import AdapterSettings
from tests.adapter.fakes import FakeEngine


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    app = create_app(AdapterSettings(served_model_name="tiny"), engine=engine)
    # Server exceptions raise in the test: every expected error must be handled by the app.
    with TestClient(app) as test_client:
        yield test_client
