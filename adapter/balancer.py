"""Several Triton replicas behind one adapter: which address serves the next request.

The targets are `host:port` items; a name is resolved to its addresses (IPv4 ones when it has
any) and re-resolved periodically, so replicas behind a DNS name that come and go are picked
up. Requests go round-robin over the replicas that are up; one marked down (a connection
error) is probed in the background until it is ready again. Knows nothing of gRPC: the engine
passes how to make a client and how to probe an address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

Client = TypeVar("Client")
Resolver = Callable[[str, int], Awaitable[list[str]]]
"""(host, port) -> the host's addresses; raises `OSError` when the name does not resolve."""

RESOLVE_INTERVAL_S = 30.0
PROBE_INTERVAL_S = 1.0


def split_targets(urls: str) -> list[tuple[str, int]]:
    """`host1:8001,host2:8001` (IPv6 as `[addr]:port`) as (host, port) pairs."""
    targets = []
    for item in (part.strip() for part in urls.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"a Triton URL is `host:port`, got {item!r}")
        targets.append((host.removeprefix("[").removesuffix("]"), int(port)))
    if not targets:
        raise ValueError("no Triton URL given")
    return targets


def address(host: str, port: int) -> str:
    """`host:port` as gRPC takes it, brackets around an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_ip(host: str) -> bool:
    """`host` is an address literal, nothing to resolve."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve(host: str, port: int) -> list[str]:
    """The host's addresses by `getaddrinfo`: the IPv4 ones if any, else the IPv6 ones."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = [str(info[4][0]) for info in infos if info[0] == socket.AF_INET]
    v6 = [str(info[4][0]) for info in infos if info[0] == socket.AF_INET6]
    return list(dict.fromkeys(v4 or v6))


class Balancer(Generic[Client]):
    """Round-robin over the current replicas that are up; one client per address, made lazily.

    All replicas down: `pick` still returns one, so a lone Triton behaves as without balancing
    (its calls fail fast until it is back).
    """

    def __init__(
        self,
        targets: Sequence[tuple[str, int]],
        make_client: Callable[[str], Client],
        resolver: Resolver = resolve,
    ) -> None:
        self._targets = list(targets)
        self._make_client = make_client
        self._resolver = resolver
        self._resolved: dict[tuple[str, int], list[str]] = {}
        self._addresses: list[str] = []
        self._down: set[str] = set()
        self._clients: dict[str, Client] = {}
        self._next = 0

    @property
    def addresses(self) -> list[str]:
        """The current replicas, in resolution order."""
        return list(self._addresses)

    @property
    def clients(self) -> list[Client]:
        """Every client made so far, of current replicas or of ones that went away."""
        return list(self._clients.values())

    def is_up(self, address_: str) -> bool:
        return address_ not in self._down

    @property
    def any_up(self) -> bool:
        return any(self.is_up(a) for a in self._addresses)

    async def refresh(self) -> None:
        """Re-resolves the names; a name that fails to resolve keeps its last addresses (or
        itself, at first, so that the calls report it)."""
        addresses: list[str] = []
        for host, port in self._targets:
            if is_ip(host):
                found = [address(host, port)]
            else:
                try:
                    found = [address(ip, port) for ip in await self._resolver(host, port)]
                except OSError as exc:
                    logger.warning("cannot resolve Triton host %s: %s", host, exc)
                    found = []
                found = found or self._resolved.get((host, port)) or [address(host, port)]
            self._resolved[(host, port)] = found
            addresses.extend(found)
        addresses = list(dict.fromkeys(addresses))
        if addresses != self._addresses:
            logger.info("Triton replicas: %s", ", ".join(addresses))
        self._addresses = addresses
        self._down &= set(addresses)

    def pick(self, exclude: Collection[str] = ()) -> str | None:
        """The next replica not in `exclude`, preferring ones that are up; None if none is left."""
        candidates = [a for a in self._addresses if a not in exclude]
        pool = [a for a in candidates if self.is_up(a)] or candidates
        if not pool:
            return None
        chosen = pool[self._next % len(pool)]
        self._next += 1
        return chosen

    def client(self, address_: str) -> Client:
        """The address's client, made on first use."""
        if address_ not in self._clients:
            self._clients[address_] = self._make_client(address_)
        return self._clients[address_]

    def mark_down(self, address_: str, reason: object) -> None:
        if address_ in self._addresses and address_ not in self._down:
            logger.warning("Triton replica %s is down: %s", address_, reason)
            self._down.add(address_)

    def mark_up(self, address_: str) -> None:
        if address_ in self._down:
            logger.info("Triton replica %s is up again", address_)
            self._down.discard(address_)

    async def watch(
        self,
        probe: Callable[[str], Awaitable[bool]],
        probe_interval_s: float = PROBE_INTERVAL_S,
        resolve_interval_s: float = RESOLVE_INTERVAL_S,
    ) -> None:
        """Forever: probes the replicas that are down, re-resolves the names now and then."""
        loop = asyncio.get_running_loop()
        resolved_at = loop.time()
        while True:
            await asyncio.sleep(probe_interval_s)
            if loop.time() - resolved_at >= resolve_interval_s:
                await self.refresh()
                resolved_at = loop.time()
            down = [a for a in self._addresses if not self.is_up(a)]
            probes = await asyncio.gather(*(probe(a) for a in down), return_exceptions=True)
            for address_, ready in zip(down, probes, strict=True):
                if isinstance(ready, Exception):  # the watcher outlives a probe's failure
                    logger.warning("probing Triton replica %s failed: %r", address_, ready)
                elif ready:
                    self.mark_up(address_)
