"""RemoteBackend: the app's backend over any OpenAI-compatible server (vLLM, SGLang, llama.cpp's
server, Ollama's /v1, another `rosechat serve`).

It offers the EngineThread's commands (new_conversation, submit_turn, abort, fork_conversation,
drop_conversation, request_snapshot, shutdown) and reports through the same events (TurnStarted,
TokenDelta, Finished, EngineError, CacheSnapshot), so a tab cannot tell which one it talks to.
The server keeps no conversation state: every turn sends the whole history, and the server's own
prefix cache (vLLM, SGLang, rosechat) is what saves the recompute.

One asyncio loop on a daemon thread runs the official `openai` client; commands reach it through
``call_soon_threadsafe`` (FIFO, so an abort always lands after its submit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from engine import SamplingParams
from engine.events import CacheSnapshot, EngineError, Event, Finished, TokenDelta, TurnStarted, Usage
from rosechat.server_stats import ServerStats, parse_metrics, snapshot_from_json

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")


def split_base_url(url: str) -> tuple[str, str]:
    """(API base ending in /v1, server root): users give either form."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    root = url[: -len("/v1")] if url.endswith("/v1") else url
    return root + "/v1", root


@dataclass
class _Turn:
    request_id: str
    conversation_id: str
    n: int
    started: float = field(default_factory=time.monotonic)
    texts: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # content chunks per sample (about one token each)
    first_token: float | None = None
    usage: Usage | None = None
    silent: bool = False  # dropped with its tab: end without a word

    def __post_init__(self) -> None:
        self.texts, self.reasons, self.chunks = [""] * self.n, [None] * self.n, [0] * self.n


class RemoteError(Exception):
    """A server answer the user can act on, already worded for the tab."""


class RemoteBackend:
    def __init__(
        self,
        base_url: str,
        on_event: Callable[[Event | ServerStats], None],
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 5.0,
        send: Collection[str] = SAMPLING_FIELDS,
        snapshot_interval: float = 1.0,
    ) -> None:
        self.base_url, self.root_url = split_base_url(base_url)
        self.on_event = on_event
        self.api_key = api_key
        self.model = model  # None: the server's first model, asked on the first turn
        self.send = frozenset(send) & set(SAMPLING_FIELDS)  # fields sent; the others stay the server's own
        self.snapshot_interval = snapshot_interval
        self._timeout = openai.Timeout(timeout, connect=connect_timeout)
        self._ids = itertools.count()
        self._salts: dict[str, str] = {}  # conversation id -> its cache_salt, sent with each of its turns
        self._loop = asyncio.new_event_loop()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._turns: dict[str, _Turn] = {}
        self._thread = threading.Thread(target=self._loop.run_forever, name="rosechat-remote", daemon=True)
        self._wake: asyncio.Event | None = None
        self._stats_kind: str | None = None  # "rosechat", "metrics" or "none", found on first poll

    # ------------------------------------------------------------------ commands (any thread)
    def start(self) -> None:
        self._thread.start()
        self._loop.call_soon_threadsafe(self._setup)

    def new_conversation(self, cache_salt: str | None = None) -> str:
        cid = f"conv-{next(self._ids)}"
        if cache_salt is not None:
            self._salts[cid] = cache_salt
        return cid

    def fork_conversation(self, conversation_id: str) -> str:
        # the history travels with every turn: nothing to copy but the salt
        return self.new_conversation(self._salts.get(conversation_id))

    def submit_turn(self, conversation_id: str, messages: list[dict[str, str]], params: SamplingParams) -> str:
        rid = f"turn-{next(self._ids)}"
        self._loop.call_soon_threadsafe(self._start_turn, _Turn(rid, conversation_id, params.n), list(messages),
                                        params)
        return rid

    def abort(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._cancel, request_id, False)

    def drop_conversation(self, conversation_id: str) -> None:
        self._loop.call_soon_threadsafe(self._drop, conversation_id)

    def request_snapshot(self) -> None:
        self._loop.call_soon_threadsafe(lambda: self._wake and self._wake.set())

    def shutdown(self, timeout: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        closing = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
        try:
            closing.result(timeout)
        except (TimeoutError, concurrent.futures.TimeoutError):  # a server slow to hang up: go anyway
            closing.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the loop thread
    def _setup(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # The openai client insists on a key even for a local server, and by default retries twice
        # and waits 10 minutes: both made explicit here.
        self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "none",
                                          max_retries=0, timeout=self._timeout)
        self._http = httpx.AsyncClient(base_url=self.root_url, headers=headers, timeout=self._timeout.connect)
        self._wake = asyncio.Event()
        self._poller = self._loop.create_task(self._poll())

    async def _close(self) -> None:
        for rid in list(self._tasks):
            self._cancel(rid, True)
        self._poller.cancel()
        await asyncio.gather(*self._tasks.values(), self._poller, return_exceptions=True)
        await self._client.close()
        await self._http.aclose()

    def _emit(self, event: Event | ServerStats) -> None:
        try:
            self.on_event(event)
        except Exception:  # a broken listener must not stop the client
            pass

    def _start_turn(self, turn: _Turn, messages: list[dict[str, str]], params: SamplingParams) -> None:
        self._turns[turn.request_id] = turn
        task = self._loop.create_task(self._run_turn(turn, messages, params))
        self._tasks[turn.request_id] = task
        task.add_done_callback(lambda t: self._end(turn, t))
        self._wake.set()  # the panel follows the server while a turn runs

    def _cancel(self, request_id: str, silent: bool) -> None:
        if (task := self._tasks.get(request_id)) is not None:
            self._turns[request_id].silent |= silent
            task.cancel()

    def _drop(self, conversation_id: str) -> None:
        self._salts.pop(conversation_id, None)
        for rid, turn in list(self._turns.items()):
            if turn.conversation_id == conversation_id:
                self._cancel(rid, True)

    def _end(self, turn: _Turn, task: asyncio.Task[None]) -> None:
        """Every turn ends here, once: finished, aborted (its text so far kept) or failed."""
        self._tasks.pop(turn.request_id, None)
        self._turns.pop(turn.request_id, None)
        self._wake.set()  # the panel shows the server as the turn left it
        if turn.silent:
            return
        error = None if task.cancelled() else task.exception()
        if error is not None:
            code = getattr(error, "code", None) or "remote_error"
            if code == "context_length_exceeded" and getattr(error, "param", None) == "max_tokens":
                code = "invalid_request"  # the reply's limit does not fit, not the message: it stays in the chat
            message = describe(error, self.base_url, mid_reply=any(turn.chunks))
            self._emit(EngineError(turn.request_id, turn.conversation_id, message, code))
            return
        now = time.monotonic()
        first = turn.first_token or now
        usage = turn.usage or Usage(0, 0, sum(turn.chunks))
        decode = now - first
        reasons = tuple("abort" if task.cancelled() and r is None else (r or "stop") for r in turn.reasons)
        self._emit(Finished(
            request_id=turn.request_id, conversation_id=turn.conversation_id, texts=tuple(turn.texts),
            finish_reasons=reasons, usage=usage, ttft_s=first - turn.started, total_s=now - turn.started,
            tokens_per_s=usage.completion_tokens / decode if decode > 0 else 0.0,
            sample_tokens=tuple(turn.chunks),
            sample_tokens_per_s=tuple(c / decode if decode > 0 else 0.0 for c in turn.chunks),
        ))

    async def _run_turn(self, turn: _Turn, messages: list[dict[str, str]], params: SamplingParams) -> None:
        self._emit(TurnStarted(turn.request_id, turn.conversation_id, 0, 0, params.max_tokens, False, 0))
        if self.model is None:
            self.model = await self._first_model()
        try:
            await self._stream(turn, messages, params, list(range(params.n)))
        except openai.BadRequestError:
            if params.n == 1 or any(turn.chunks):
                raise
            # llama.cpp's server refuses n > 1: ask for each alternative separately
        # fewer choices came back (Ollama ignores n): one request per alternative still missing
        missing = [i for i in range(params.n) if turn.reasons[i] is None and not turn.chunks[i]]
        if missing and params.n > 1:
            await asyncio.gather(*(self._stream(turn, messages, params, [i]) for i in missing))
        if None in turn.reasons:  # a stream cut without a finish reason: the server went away
            raise RemoteError(f"the server at {self.base_url} went away mid-reply (the stream ended without a "
                              "finish reason); the text so far is kept")

    async def _first_model(self) -> str:
        models = await self._client.models.list()
        if not models.data:
            raise RemoteError(f"the server at {self.base_url} lists no models")
        return models.data[0].id

    def _request_args(self, params: SamplingParams, n: int, sample: int, salt: str | None) -> dict[str, Any]:
        args: dict[str, Any] = {"n": n, "max_tokens": params.max_tokens}
        if params.stop:
            args["stop"] = params.stop
        extra: dict[str, Any] = {}  # fields outside OpenAI's schema; vLLM, SGLang and llama.cpp read them
        # alternatives are samples: their temperature goes even where the server's default is kept
        for name in self.send | ({"temperature"} if params.n > 1 else set()):
            value = getattr(params, name)
            if name in ("temperature", "top_p"):
                args[name] = value
            elif name == "seed" and value is not None:
                args["seed"] = value + sample  # separate requests for alternatives must differ
            elif name in ("top_k", "min_p") and value or name == "repetition_penalty" and value != 1.0:
                extra[name] = value
        if params.ignore_eos:
            extra["ignore_eos"] = True
        if (spec := params.structured) is not None:  # JSON mode (or a schema): OpenAI's field, vLLM's for the rest
            if spec.json_object:
                args["response_format"] = {"type": "json_object"}
            elif spec.json is not None and not (spec.prefix or spec.suffix):
                schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
                args["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "reply", "schema": schema, "strict": True}}
            else:
                extra["structured_outputs"] = {k: v for k in ("json", "regex", "choice", "grammar")
                                               if (v := getattr(spec, k)) is not None}
        if salt is not None:
            extra["cache_salt"] = salt
        if extra:
            args["extra_body"] = extra
        return args

    async def _stream(self, turn: _Turn, messages: list[dict[str, str]], params: SamplingParams,
                      samples: list[int]) -> None:
        """One streaming request; its choice k fills sample samples[k]."""
        stream = await self._client.chat.completions.create(
            model=self.model, messages=messages, stream=True, stream_options={"include_usage": True},
            **self._request_args(params, len(samples), samples[0], self._salts.get(turn.conversation_id)))
        async with stream:
            async for chunk in stream:
                if chunk.usage is not None:
                    turn.usage = _add_usage(turn.usage, chunk.usage)
                for choice in chunk.choices:
                    if choice.index >= len(samples):
                        continue
                    i = samples[choice.index]
                    if text := (choice.delta.content if choice.delta else None):
                        turn.first_token = turn.first_token or time.monotonic()
                        turn.texts[i] += text
                        turn.chunks[i] += 1
                        self._emit(TokenDelta(turn.request_id, turn.conversation_id, i, text))
                    if choice.finish_reason:
                        turn.reasons[i] = "length" if choice.finish_reason == "length" else "stop"

    # ------------------------------------------------------------------ KV panel data
    async def _poll(self) -> None:
        """While turns run (and on request), read what the server tells of its KV cache."""
        assert self._wake is not None
        while True:
            if self._tasks:  # a turn runs: follow the server
                await asyncio.sleep(self.snapshot_interval)
            else:  # idle: when asked, or as a turn starts or ends
                await self._wake.wait()
            self._wake.clear()
            stats = await self._server_stats()
            if stats is not None:
                self._emit(stats)

    async def _server_stats(self) -> CacheSnapshot | ServerStats | None:
        try:
            if self._stats_kind in (None, "rosechat"):
                r = await self._http.get("/v1/rosechat/kv")
                if r.status_code == 200:
                    self._stats_kind = "rosechat"
                    return snapshot_from_json(r.json())
            if self._stats_kind in (None, "metrics"):
                r = await self._http.get("/metrics")
                if r.status_code == 200 and (stats := parse_metrics(r.text)).server:
                    self._stats_kind = "metrics"
                    return stats
            self._stats_kind = "none"
            return ServerStats(server="")
        except (httpx.HTTPError, ValueError):
            return None  # unreachable now: the turn's own error says so; try again next time


def _add_usage(old: Usage | None, new: Any) -> Usage:
    """Usage from a chunk, summed over the separate requests of one turn."""
    details = getattr(new, "prompt_tokens_details", None)
    cached = (getattr(details, "cached_tokens", None) or 0) if details is not None else 0
    prompt, completion = new.prompt_tokens or 0, new.completion_tokens or 0
    if old is None:
        return Usage(prompt, prompt - cached, completion)
    return Usage(old.prompt_tokens, old.prefilled_tokens + prompt - cached, old.completion_tokens + completion)


def unreachable(base_url: str, api_key: str | None, timeout: float = 5.0) -> str | None:
    """Why the server cannot take a turn yet (down, or still loading its model: 503), or None when it
    answers. Any other answer (a wrong key, 404) counts as up: the tab that meets it says so."""
    base, _ = split_base_url(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base}/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        return f"cannot reach {base} ({type(e).__name__})"
    if response.status_code != 503:
        return None
    try:
        said = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        said = response.text[:200] or "503"
    return f"{base} is not ready: {said}"


def describe(error: BaseException, url: str, mid_reply: bool = False) -> str:
    """One line a user can act on."""
    if mid_reply and isinstance(error, openai.APIConnectionError):
        cause = error.__cause__ or error
        return f"the server at {url} went away mid-reply ({type(cause).__name__}); the text so far is kept"
    if isinstance(error, openai.APITimeoutError):
        return f"the server at {url} did not answer in time"
    if isinstance(error, openai.APIConnectionError):
        cause = error.__cause__ or error
        return f"cannot reach the server at {url} ({type(cause).__name__}: {cause}); retry once it is up"
    if isinstance(error, openai.AuthenticationError):
        return f"the server at {url} refused the API key (401): set --api-key or remote.api_key"
    if isinstance(error, openai.NotFoundError):
        return f"the server at {url} answered 404: {_message(error)} (check --model / remote.model)"
    if isinstance(error, openai.APIStatusError):
        return f"the server at {url} answered {error.status_code}: {_message(error)}"
    if isinstance(error, RemoteError):
        return str(error)
    return f"remote request failed: {type(error).__name__}: {error}"


def _message(error: openai.APIStatusError) -> str:
    body = error.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
    return error.message
