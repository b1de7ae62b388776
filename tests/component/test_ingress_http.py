"""The ingress's own HTTP server (`coordinator.ingress_http`), on this process's event loop.

It serves the app it is given until stopped, frees the address when stopped (a restarted
replica binds it again), and refuses an address in use with the address in the message.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from fastapi import FastAPI

from coordinator.ingress_http import DirectHttp, HttpBinding
from elasticmoe.entrypoints.listen_address import AddressUnavailable
from elasticmoe.entrypoints.openai.access import AccessPolicy
from elasticmoe.utils.ports import free_port


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict:
        return {"pong": True}

    return app


def test_serves_until_stopped_and_frees_the_address():
    binding = HttpBinding("127.0.0.1", free_port())

    async def run() -> None:
        for _ in range(2):  # the second start rebinds the address the first one freed
            http = await DirectHttp.start(_app(), binding, AccessPolicy())
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{binding.port}") as c:
                assert (await c.get("/ping")).json() == {"pong": True}
            await http.stop()
            assert http.task.done()
            with pytest.raises(httpx.ConnectError):
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{binding.port}") as c:
                    await c.get("/ping")

    asyncio.run(run())


def test_an_address_in_use_is_refused_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def start() -> None:
            await DirectHttp.start(_app(), HttpBinding("127.0.0.1", port), AccessPolicy())

        with pytest.raises(AddressUnavailable, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            asyncio.run(start())
