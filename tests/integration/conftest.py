"""Fixtures of the integration tests: the adapter in front of the session's tritonserver."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest

from backend.adapter_server import AdapterServer


@pytest.fixture(scope="session")
def adapter_server(
    triton_server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AdapterServer]:
    log_path = tmp_path_factory.mktemp("adapter") / "adapter.log"
    server = AdapterServer(
        triton_url=triton_server.grpc_url, port=0, served_model_name="test-model", log_path=log_path
    )
    with server:
        yield server


@pytest.fixture
def http(adapter_server: AdapterServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=adapter_server.url, timeout=60) as client:
        yield client


@pytest.fixture
def openai_client(adapter_server: AdapterServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=adapter_server.base_url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
async def async_openai_client(adapter_server: AdapterServer) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=adapter_server.base_url, api_key="unused", max_retries=0)
    async with client:
        yield client
