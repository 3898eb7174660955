"""Runs the HTTP app with uvicorn inside the gRPC server's asyncio loop (one process, one
engine): uvicorn's own signal handling is off, the CLI's SIGTERM handler stops both."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp

from inference_service.http.config import HttpConfig

log = logging.getLogger("loraplex.http")


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the gRPC side owns SIGINT/SIGTERM and stops us


class RunningHttp:
    def __init__(self, server: uvicorn.Server, task: asyncio.Task) -> None:
        self.server, self.task = server, task

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_http(app: ASGIApp, config: HttpConfig, grace_s: float) -> RunningHttp:
    """Serving once this returns; raises RuntimeError when the port cannot be bound."""
    server = _EmbeddedServer(uvicorn.Config(
        app, host=config.addr, port=config.port, log_level="warning", access_log=False, lifespan="off",
        http="httptools",  # chosen by measurement over h11: docs/http.md
        timeout_graceful_shutdown=max(1, int(grace_s)),
    ))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():  # uvicorn logs the bind error and exits
            raise RuntimeError(f"HTTP front end could not listen on {config.addr}:{config.port}")
        await asyncio.sleep(0.01)
    log.info("OpenAI-compatible HTTP API listening on %s:%d", config.addr, config.port)
    return RunningHttp(server, task)
