"""Serving while the model loads: the socket answers from the first second, and says how far loading is.

``LoadingServer`` is the ASGI app uvicorn runs. It loads the model on a thread; until the engine is up,
``/health`` answers 503 with the stage (``{"status": "loading", "stage": ..., "done": n, "total": N,
"elapsed_s": s}``) and every other path 503 ``model_loading`` with Retry-After, as a load balancer or
an agent's retry loop expects. Once loaded it builds the real app (server/app.py), runs that app's
lifespan (the engine thread) and hands every request to it. A load that fails is logged and ends the
server (``on_failed``): a server without a model serves nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine import LLMEngine
from engine.events import LoadProgress
from rosechat.server.errors import error_body

Scope = dict[str, Any]
Load = Callable[[Callable[[LoadProgress], None]], LLMEngine]  # the model's load, given where to report stages


class LoadingServer:
    def __init__(self, load: Load, build: Callable[[LLMEngine], FastAPI], *, log: Callable[[str], None],
                 on_ready: Callable[[LLMEngine], None] = lambda _: None,
                 on_failed: Callable[[str], None] = lambda _: None) -> None:
        self._load, self._build, self._log = load, build, log
        self._on_ready, self._on_failed = on_ready, on_failed
        self.progress: LoadProgress | None = None
        self.error: str | None = None
        self.app: FastAPI | None = None  # the real app, once the model is loaded and its engine runs
        self._lifespan: contextlib.AbstractAsyncContextManager[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan_protocol(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._not_ready(scope)(scope, receive, send)

    async def _lifespan_protocol(self, receive: Callable, send: Callable) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._loop = asyncio.get_running_loop()
                threading.Thread(target=self._run_load, name="rosechat-load", daemon=True).start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self._stopping = True
                if self._lifespan is not None:  # the engine thread stops
                    await self._lifespan.__aexit__(None, None, None)
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _not_ready(self, scope: Scope) -> JSONResponse:
        p = self.progress
        status = {"status": "failed" if self.error else "loading", "stage": p.stage if p else "starting",
                  "done": p.done if p else 0, "total": p.total if p else 0,
                  "elapsed_s": round(p.elapsed_s, 1) if p else 0.0}
        if self.error:
            status["error"] = self.error
        if scope["path"] == "/health":
            return JSONResponse(status, status_code=503, headers={"Retry-After": "1"})
        why = f"the model failed to load: {self.error}" if self.error else f"the model is loading ({p or 'starting'})"
        return JSONResponse(error_body(503, why, None, "model_loading"), status_code=503,
                            headers={"Retry-After": "1"})

    # ------------------------------------------------------------------ the load (its own thread)
    def _report(self, progress: LoadProgress) -> None:
        last, self.progress = self.progress, progress
        if last is None or last.stage != progress.stage:
            self._log(f"loading: {progress}")
        elif progress.total and progress.done * 4 // progress.total != last.done * 4 // progress.total:
            self._log(f"loading: {progress}")  # a long counted stage: every quarter

    def _run_load(self) -> None:
        try:
            llm = self._load(self._report)
        except Exception as e:  # the server's own failure, said once; the process ends with it
            self.error = f"{type(e).__name__}: {e}"
            self._log(f"the model failed to load: {self.error}")
            self._on_failed(self.error)
            return
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._start(llm), self._loop)

    async def _start(self, llm: LLMEngine) -> None:
        if self._stopping:  # Ctrl+C while loading: nothing to start
            return
        app = self._build(llm)
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        self._lifespan, self.app = lifespan, app
        self._on_ready(llm)
