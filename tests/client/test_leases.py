"""ClientLeases: one client per request in flight, at most `limit`, all closed at the end."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from client import AsyncClient
from client import TimeoutError as ClientTimeoutError
from client._leases import ClientLeases

pytestmark = pytest.mark.unit

URL = "http://127.0.0.1:9/v1/predict"


def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={})


class Maker:
    """Makes mock-transport clients and keeps them, to check what became of each."""

    def __init__(self, fail_first: int = 0) -> None:
        self.clients: list[AsyncClient] = []
        self.fail_first = fail_first

    def __call__(self) -> AsyncClient:
        if self.fail_first:
            self.fail_first -= 1
            raise OSError("no client this time")
        client = AsyncClient(transport=httpx.MockTransport(ok), max_retries=0)
        self.clients.append(client)
        return client


async def test_each_client_serves_one_request_at_a_time_and_at_most_limit_exist() -> None:
    maker = Maker()
    busy: set[int] = set()
    most = 0

    async def request() -> None:
        nonlocal most
        async with leases.lease() as client:
            assert id(client) not in busy
            busy.add(id(client))
            most = max(most, len(busy))
            for _ in range(3):
                await asyncio.sleep(0)
            busy.remove(id(client))

    async with ClientLeases(maker, 3, wait_s=None, url=URL) as leases:
        await asyncio.gather(*(request() for _ in range(20)))
        assert leases.made == len(maker.clients) == 3
    assert most == 3


async def test_an_idle_client_is_lent_again_rather_than_a_new_one_made() -> None:
    maker = Maker()
    async with ClientLeases(maker, 8, wait_s=None, url=URL) as leases:
        for _ in range(5):
            async with leases.lease() as client:
                await client.metrics()
        assert leases.made == 1


async def test_every_client_made_is_closed_on_leaving() -> None:
    maker = Maker()

    async def hold() -> None:
        async with leases.lease():
            await asyncio.sleep(0)

    async with ClientLeases(maker, 4, wait_s=None, url=URL) as leases:
        await asyncio.gather(*(hold() for _ in range(4)))
        assert not any(client._http.is_closed for client in maker.clients)
    assert len(maker.clients) == 4
    assert all(client._http.is_closed for client in maker.clients)


async def test_a_wait_longer_than_wait_s_is_a_timeout_naming_the_url() -> None:
    async with ClientLeases(Maker(), 1, wait_s=0.01, url=URL) as leases:
        async with leases.lease():
            with pytest.raises(ClientTimeoutError) as raised:
                async with leases.lease():
                    pass
        assert raised.value.url == URL
        assert "all 1 clients busy" in str(raised.value)
        # The slot came back: the next lease gets the one client there is.
        async with leases.lease():
            assert leases.made == 1


async def test_a_client_that_could_not_be_made_frees_its_slot() -> None:
    maker = Maker(fail_first=1)
    async with ClientLeases(maker, 1, wait_s=0.01, url=URL) as leases:
        with pytest.raises(OSError):
            async with leases.lease():
                pass
        async with leases.lease() as client:
            await client.metrics()
        assert leases.made == 1


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ClientLeases(Maker(), 0, wait_s=None, url=URL)
