"""Replica choice without Triton: round-robin over the ones up, marking down and up, DNS."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from tritonclient.utils import InferenceServerException

from adapter.balancer import Balancer, split_targets
from adapter.errors import EngineUnavailableError
from adapter.tensors import TritonRequest
from adapter.triton_client import TritonEngineClient
from tests.adapter.test_triton_client import FakeCall, FakeClient, token


class FakeResolver:
    """Answers from a table that tests change; an absent name fails as DNS does."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table

    async def __call__(self, host: str, port: int) -> list[str]:
        if host not in self.table:
            raise OSError(f"no such host {host}")
        return self.table[host]


def balancer(urls: str, resolver: FakeResolver | None = None) -> Balancer[str]:
    return Balancer(
        split_targets(urls), lambda address: f"client {address}", resolver or FakeResolver({})
    )


def test_split_targets() -> None:
    assert split_targets("a:1, b:2,[::1]:3") == [("a", 1), ("b", 2), ("::1", 3)]
    for bad in ("", "a", "a:x", ":1"):
        with pytest.raises(ValueError):
            split_targets(bad)


async def test_round_robin_over_the_replicas_up() -> None:
    lb = balancer("10.0.0.1:1,10.0.0.2:1,10.0.0.3:1")
    await lb.refresh()
    assert [lb.pick() for _ in range(6)] == ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"] * 2
    lb.mark_down("10.0.0.2:1", "refused")
    assert not lb.is_up("10.0.0.2:1") and lb.any_up
    assert {lb.pick() for _ in range(4)} == {"10.0.0.1:1", "10.0.0.3:1"}
    assert lb.pick(exclude={"10.0.0.1:1"}) == "10.0.0.3:1"
    lb.mark_up("10.0.0.2:1")
    assert {lb.pick() for _ in range(3)} == set(lb.addresses)


async def test_all_down_still_picks_one_but_never_an_excluded_one() -> None:
    lb = balancer("10.0.0.1:1")
    await lb.refresh()
    lb.mark_down("10.0.0.1:1", "refused")
    assert not lb.any_up
    assert lb.pick() == "10.0.0.1:1"  # a lone Triton is tried, as without balancing
    assert lb.pick(exclude={"10.0.0.1:1"}) is None


async def test_clients_are_made_once_per_address() -> None:
    lb = balancer("10.0.0.1:1,10.0.0.2:1")
    await lb.refresh()
    assert lb.client("10.0.0.1:1") == "client 10.0.0.1:1"
    assert lb.client("10.0.0.1:1") is lb.client("10.0.0.1:1")
    assert lb.clients == ["client 10.0.0.1:1"]


async def test_a_name_expands_to_its_addresses_and_follows_dns() -> None:
    resolver = FakeResolver({"triton": ["10.0.0.1", "10.0.0.2"], "v6": ["fd00::1"]})
    lb = balancer("triton:8001,v6:8001", resolver)
    await lb.refresh()
    assert lb.addresses == ["10.0.0.1:8001", "10.0.0.2:8001", "[fd00::1]:8001"]
    lb.mark_down("10.0.0.2:8001", "refused")

    resolver.table["triton"] = ["10.0.0.2", "10.0.0.3"]  # one replica went, one came
    await lb.refresh()
    assert lb.addresses == ["10.0.0.2:8001", "10.0.0.3:8001", "[fd00::1]:8001"]
    assert not lb.is_up("10.0.0.2:8001") and lb.is_up("10.0.0.3:8001")

    del resolver.table["triton"]  # DNS fails: the last answer stays
    await lb.refresh()
    assert lb.addresses[:2] == ["10.0.0.2:8001", "10.0.0.3:8001"]


async def test_an_unresolvable_name_is_kept_for_grpc_to_report() -> None:
    lb = balancer("nowhere:8001")
    await lb.refresh()
    assert lb.addresses == ["nowhere:8001"]


async def test_watch_probes_the_replicas_down_and_re_resolves() -> None:
    resolver = FakeResolver({"triton": ["10.0.0.1", "10.0.0.2"]})
    lb = balancer("triton:1", resolver)
    await lb.refresh()
    lb.mark_down("10.0.0.1:1", "refused")
    probed: list[str] = []

    async def probe(address: str) -> bool:
        probed.append(address)
        return len(probed) >= 2  # ready at the second probe

    resolver.table["triton"] = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    watcher = asyncio.create_task(lb.watch(probe, probe_interval_s=0.01, resolve_interval_s=0.01))
    try:
        async with asyncio.timeout(30):
            while not lb.is_up("10.0.0.1:1") or len(lb.addresses) < 3:
                await asyncio.sleep(0.01)
    finally:
        watcher.cancel()
    assert set(probed) == {"10.0.0.1:1"}  # only the one down is probed
    assert lb.addresses[-1] == "10.0.0.3:1"


async def test_the_watcher_outlives_a_probe_that_raises() -> None:
    lb = balancer("10.0.0.1:1", FakeResolver({}))
    await lb.refresh()
    lb.mark_down("10.0.0.1:1", "refused")
    probes = 0

    async def probe(address: str) -> bool:
        nonlocal probes
        probes += 1
        if probes == 1:
            raise RuntimeError("a probe's own bug")
        return True

    watcher = asyncio.create_task(lb.watch(probe, probe_interval_s=0.01))
    try:
        async with asyncio.timeout(30):
            while not lb.is_up("10.0.0.1:1"):
                await asyncio.sleep(0.01)
    finally:
        watcher.cancel()
    assert probes == 2  # it went on probing after the first one raised


def unavailable() -> InferenceServerException:
    return InferenceServerException("failed to connect", status="StatusCode.UNAVAILABLE")


class DownClient(FakeClient):
    """A replica that refuses every connection."""

    def __init__(self) -> None:
        super().__init__(FakeCall([]), prompt_ids=unavailable())

    async def is_server_ready(self, client_timeout: float) -> bool:
        raise unavailable()


def two_replicas(down: FakeClient, up: FakeClient) -> TritonEngineClient:
    clients: dict[str, Any] = {"10.0.0.1:1": down, "10.0.0.2:1": up}
    lb = Balancer(split_targets("10.0.0.1:1,10.0.0.2:1"), clients.__getitem__)
    return TritonEngineClient("unused:1", balancer=lb)


async def test_a_request_fails_over_once_and_the_replica_is_marked_down() -> None:
    up = FakeClient(FakeCall([token(1, final=True)]))
    engine = two_replicas(DownClient(), up)
    try:
        [out] = [o async for o in engine.generate(TritonRequest(text="hi"), "r")]
        assert out.final
        assert len(up.requests) == 1  # tokenized and generated on the replica that is up
        assert up.tokenized == [("preprocessing", ["TEXT_INPUT"])]
        assert not engine._balancer.is_up("10.0.0.1:1")
        assert await engine.tokenize(TritonRequest(text="x"), "r2") == [1, 2, 3]
        assert await engine.is_ready()
    finally:
        await engine.close()


async def test_no_retry_without_another_replica_or_for_other_errors() -> None:
    engine = TritonEngineClient("unused:1", client=DownClient())  # type: ignore[arg-type]
    with pytest.raises(EngineUnavailableError):
        _ = [o async for o in engine.generate(TritonRequest(text="hi"), "r")]
    assert not await engine.is_ready()
    await engine.close()

    error = SimpleNamespace(message=lambda: "server busy: 8 requests are waiting")
    busy = FakeClient(FakeCall([(None, error)]))
    other = FakeClient(FakeCall([token(1, final=True)]))
    engine = two_replicas(busy, other)
    with pytest.raises(EngineUnavailableError, match="server busy"):
        _ = [o async for o in engine.generate(TritonRequest(prompt_ids=(1,)), "r")]
    assert other.requests == [] and engine._balancer.is_up("10.0.0.1:1")
    await engine.close()
