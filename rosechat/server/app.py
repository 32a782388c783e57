"""The ASGI app: OpenAI-compatible routes over one EngineHub.

Each request is rendered to prompt tokens here (so over-long prompts get a 400 rather than the
app's silent dropping of old messages), submitted as one engine turn on a fresh conversation,
and the conversation is dropped when the reply ends: its full blocks stay in the prefix cache,
so a client resending a growing history prefills only what is new.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from engine import EngineError, Finished, GrammarError, LLMEngine, SamplingParams, TokenDelta, TokenLogprob
from rosechat.server import tools
from rosechat.server.errors import APIError, error_body, install_error_handlers
from rosechat.server.guard import Guard
from rosechat.server.hub import EngineHub, Turn
from rosechat.server.logprobs import LogprobFormatter
from rosechat.server.metrics import ServerMetrics
from rosechat.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, extra_fields
from rosechat.server.tools import StreamFilter, ToolCall, ToolPlan

log = logging.getLogger("rosechat.serve")
DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler checks that its client is still there


class TurnStream(StreamingResponse):
    """An SSE response that always ends its turn: a client gone before the first chunk cancels the
    response before its generator starts, and a generator never started runs no `finally`."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


@dataclass
class ServerSettings:
    model_name: str = "demo"
    api_key: str | None = None
    max_n: int = 16  # samples per request
    max_queued: int = 256  # requests in flight (running + waiting); more get 503
    max_body_bytes: int = 8 * 2**20
    # SamplingParams values for fields a request leaves out (the app's config and flags)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    allow_unknown_fields: bool = False  # unknown request fields: logged and ignored instead of a 400
    tool_call_parser: str = "auto"  # tools.PARSERS: the format of tool calls (auto: from the chat template)


def create_app(llm: LLMEngine, settings: ServerSettings | None = None) -> FastAPI:
    s = settings or ServerSettings()
    metrics = ServerMetrics(s.model_name, lambda: hub.snapshot)  # hub: bound below, read at scrape time
    hub = EngineHub(llm, on_finished=metrics.finished, on_abort=metrics.aborted)
    created = int(time.time())
    ctx = llm.info.max_model_len
    formatter = LogprobFormatter(llm.tokenizer)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        hub.start()
        try:
            yield
        finally:
            hub.stop()

    app = FastAPI(title="rosechat", summary="OpenAI-compatible chat and completions over rosechat's engine",
                  lifespan=lifespan, redoc_url=None)  # /docs and /openapi.json: the schema the models declare
    install_error_handlers(app)
    app.state.hub = hub
    app.state.metrics = metrics

    # ------------------------------------------------------------------ checks
    logged: set[str] = set()

    def check_request(body: ChatCompletionRequest | CompletionRequest) -> None:
        if body.model is not None and body.model != s.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {s.model_name!r}",
                           param="model", code="model_not_found")
        unsupported, unknown = extra_fields(body)
        for path in set(unsupported + unknown) - logged:  # once per field, whatever the answer
            logged.add(path)
            log.warning("request field %r: %s", path, "not implemented" if path in unsupported else "unknown")
        if unsupported:
            raise APIError(400, f"{unsupported[0]} is not supported by this server", param=unsupported[0],
                           code="unsupported")
        if unknown and not s.allow_unknown_fields:
            raise APIError(400, f"unknown field {unknown[0]!r} (the server was not started with "
                           "--allow-unknown-fields)", param=unknown[0], code="unknown_field")
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")

    def sampling_params(
        body: ChatCompletionRequest | CompletionRequest, n_prompt: int, max_tokens: int | None, prompt_param: str
    ) -> SamplingParams:
        if body.n > s.max_n:
            raise APIError(400, f"n={body.n} is over this server's limit of {s.max_n}", param="n", code="invalid_value")
        if n_prompt == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param, code="invalid_value")
        if n_prompt >= ctx:
            raise APIError(400, f"this model's maximum context length is {ctx} tokens; the prompt is {n_prompt} "
                           "tokens", param=prompt_param, code="context_length_exceeded")
        room = ctx - n_prompt
        if max_tokens is not None and max_tokens > room:  # as vLLM: an explicit limit that cannot fit is an error
            raise APIError(400, f"this model's maximum context length is {ctx} tokens; you requested "
                           f"{n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} in the completion)",
                           param="max_tokens", code="context_length_exceeded")
        values = dict(s.sampling_defaults)
        values["max_tokens"] = min(max_tokens or values.get("max_tokens") or room, room)
        given = {"temperature": body.temperature, "top_p": body.top_p, "min_p": body.min_p,
                 "repetition_penalty": body.repetition_penalty, "seed": body.seed,
                 "top_k": None if body.top_k is None else max(body.top_k, 0)}
        values.update({k: v for k, v in given.items() if v is not None})
        values.update(n=body.n, stop=body.stop_list(), ignore_eos=body.ignore_eos, logprobs=body.logprobs_k())
        try:
            values["structured"], _ = body.structured()
            return SamplingParams(**values)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), code="invalid_value") from None

    async def compile_structured(body: ChatCompletionRequest | CompletionRequest, params: SamplingParams) -> None:
        """The reply's grammar, compiled in a worker thread (cached per spec): the event loop and the engine
        thread never wait on it, and a schema that does not compile is a 400 naming the field."""
        if params.structured is None:
            return
        try:
            await asyncio.to_thread(llm.structured.compile, params.structured)
        except GrammarError as e:
            raise APIError(400, str(e), param=body.structured()[1] or "tools", code="invalid_value") from None

    async def start_turn(tokens: list[int], params: SamplingParams, cache_salt: str | None) -> Turn:
        if hub.in_flight >= s.max_queued:  # a bound on the queue, never an unbounded backlog
            raise APIError(503, f"the server is at capacity ({s.max_queued} requests in flight); retry later",
                           code="server_overloaded", headers={"Retry-After": "1"})
        turn = hub.submit(tokens, params, cache_salt)
        try:
            first = await turn.events.get()  # TurnStarted, or the engine's refusal: decides the status
        except BaseException:
            hub.release(turn)
            raise
        if isinstance(first, EngineError):
            hub.release(turn)
            status = 503 if first.code == "engine_error" else 400
            raise APIError(status, first.message, code=first.code)
        return turn

    # ------------------------------------------------------------------ responses
    def usage_json(ev: Finished) -> dict[str, Any]:
        u = ev.usage
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": max(0, u.prompt_tokens - u.prefilled_tokens)}}

    async def finish_or_disconnect(request: Request, turn: Turn) -> Finished | None:
        """Wait for the reply; None when the client went away first (the handler is not cancelled
        by Starlette on a disconnect, so it polls)."""

        async def collect() -> Finished | EngineError:
            while True:
                ev = await turn.events.get()
                if isinstance(ev, (Finished, EngineError)):
                    return ev

        task = asyncio.ensure_future(collect())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if await request.is_disconnected():
                    task.cancel()
                    return None
            ev = task.result()
        finally:
            hub.release(turn)  # aborts it if still running: its blocks are freed
        if isinstance(ev, EngineError):
            raise APIError(500, ev.message, code=ev.code)
        return ev

    def sse(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    async def stream(turn: Turn, body: ChatCompletionRequest | CompletionRequest, kind: str,
                     tool_plan: ToolPlan | None = None, echo: str = "",
                     echo_tokens: list[int] | None = None) -> AsyncIterator[str]:
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": s.model_name}
        extra = {"usage": None} if include_usage else {}
        offsets = [0] * body.n  # completions' text_offset: where each sample's next piece starts

        filters = [StreamFilter(tool_plan) for _ in range(body.n)] if tool_plan else None

        prompt_ids = echo_tokens  # echoed with its logprobs: the first chunk waits for them (a delta or the end)
        waiting_echo = bool(echo) and prompt_ids is not None

        def chunk(index: int, text: str | None, finish: str | None = None, role: bool = False,
                  lps: tuple[TokenLogprob, ...] = (), calls: list[ToolCall] | None = None,
                  prompt: tuple[Any, ...] | None = None) -> str:
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text is not None:
                    delta["content"] = text
                if calls:
                    delta["tool_calls"] = [{"index": k, **c.json()} for k, c in enumerate(calls)]
                logprobs = formatter.chat(lps) if lps else None
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                logprobs = formatter.completion(lps, offsets[index], prompt) if lps or prompt else None
                offsets[index] += len(text or "")
                choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            return sse({**head, "choices": [choice], **extra})

        try:
            for i in range(body.n if kind == "chat" or echo and not waiting_echo else 0):
                yield chunk(i, None, role=True) if kind == "chat" else chunk(i, echo)
            while True:
                ev = await turn.events.get()
                if waiting_echo and isinstance(ev, (TokenDelta, Finished)) and ev.prompt_logprobs is not None:
                    for i in range(body.n):
                        yield chunk(i, echo, prompt=(prompt_ids, ev.prompt_logprobs))
                    waiting_echo = False
                if isinstance(ev, TokenDelta):
                    text = filters[ev.index].feed(ev.text) if filters else ev.text
                    if text or ev.logprobs or not filters:
                        yield chunk(ev.index, text, lps=ev.logprobs)
                elif isinstance(ev, Finished):
                    for i, reason in enumerate(ev.finish_reasons):
                        rest, calls = filters[i].finish() if filters else ("", [])
                        if rest or calls:
                            yield chunk(i, rest or None, calls=calls)
                        yield chunk(i, None if kind == "chat" else "",
                                    "tool_calls" if calls and reason == "stop" else reason)
                    if include_usage:
                        yield sse({**head, "choices": [], "usage": usage_json(ev)})
                    break
                elif isinstance(ev, EngineError):  # headers are sent: report it in the stream, as vLLM does
                    yield sse(error_body(500, ev.message, None, ev.code))
                    break
            yield "data: [DONE]\n\n"
        finally:  # also on a client disconnect (the generator is cancelled): abort, free the blocks
            hub.release(turn)

    def assistant_message(text: str, reason: str | None,
                          tool_plan: ToolPlan | None) -> tuple[dict[str, Any], str | None]:
        content, calls = tool_plan.parse(text) if tool_plan else (text, [])
        if not calls:
            return {"role": "assistant", "content": text}, reason
        return ({"role": "assistant", "content": content, "tool_calls": [c.json() for c in calls]},
                "tool_calls" if reason == "stop" else reason)

    async def respond(request: Request, body: ChatCompletionRequest | CompletionRequest, tokens: list[int],
                      params: SamplingParams, kind: str, tool_plan: ToolPlan | None = None, echo: str = "",
                      ) -> Response:  # fmt: skip
        await compile_structured(body, params)
        turn = await start_turn(tokens, params, body.cache_salt)
        if body.stream:
            echo_tokens = tokens if echo and params.prompt_logprobs is not None else None
            return TurnStream(stream(turn, body, kind, tool_plan, echo, echo_tokens), lambda: hub.release(turn))
        ev = await finish_or_disconnect(request, turn)
        if ev is None:
            return Response(status_code=499)  # nobody reads it
        lps = ev.logprobs or [None] * len(ev.texts)
        if kind == "chat":
            choices = [{"index": i, "message": message, "logprobs": None if lp is None else formatter.chat(lp),
                        "finish_reason": finish}
                       for i, (text, reason, lp) in enumerate(zip(ev.texts, ev.finish_reasons, lps))
                       for message, finish in [assistant_message(text, reason, tool_plan)]]
            obj, prefix = "chat.completion", "chatcmpl"
        else:
            prompt = (tokens, ev.prompt_logprobs) if echo and ev.prompt_logprobs is not None else None
            choices = [{"index": i, "text": echo + text,
                        "logprobs": None if lp is None else formatter.completion(lp, 0, prompt),
                        "finish_reason": reason}
                       for i, (text, reason, lp) in enumerate(zip(ev.texts, ev.finish_reasons, lps))]
            obj, prefix = "text_completion", "cmpl"
        return JSONResponse({"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                             "model": s.model_name, "choices": choices, "usage": usage_json(ev)})

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if hub.alive else 503)

    info = llm.info  # what runs the model, and why (engine/defaults.py), for clients and dashboards
    runtime = {"device": info.device, "dtype": info.dtype, "quantization": info.quantization,
               "kernels": info.kernels, "reason": info.reason}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": created,
                                            "owned_by": "rosechat", "root": llm.info.name, "max_model_len": ctx,
                                            "rosechat": runtime}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_request(body)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                     **({"tool_calls": [c.model_dump() for c in m.tool_calls]} if m.tool_calls else {}),
                     **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})} for m in body.messages]
        template = getattr(llm.tokenizer, "chat_template", None)
        try:
            tool_plan = tools.plan([t.model_dump(exclude_none=True) for t in body.tools or []],
                                   body.tool_choice if not isinstance(body.tool_choice, NamedToolChoice)
                                   else body.tool_choice.model_dump(), body.parallel_tool_calls,
                                   s.tool_call_parser, template)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice", code="invalid_value") from None
        rendered_tools = None
        if tool_plan or any(m.tool_calls or m.role == "tool" for m in body.messages):  # a call in the history
            messages, rendered_tools = tools.render_messages(tools.choose_parser(template, s.tool_call_parser),
                                                             messages, tool_plan.tools if tool_plan else None,
                                                             template)
        try:
            tokens = llm.render_chat(messages, rendered_tools)
        except Exception as e:  # the model's chat template refused them (roles out of order, ...)
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages",
                           code="invalid_value") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = sampling_params(body, len(tokens), max_tokens, "messages")
        if tool_plan and tool_plan.forced:  # a call it must make: held to the format, arguments to the schema
            if params.structured is not None:
                raise APIError(400, "tool_choice that requires a call cannot be combined with response_format or "
                               "guided_*", param="tool_choice", code="invalid_value")
            params = dataclasses.replace(params, structured=tool_plan.structured())
        return await respond(request, body, tokens, params, "chat", tool_plan)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_request(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request: send a batch as separate requests", param="prompt",
                               code="unsupported")
            prompt = prompt[0]
        tokens = llm.encode(prompt)  # type: ignore[arg-type]  # token ids out of the vocabulary: the engine refuses
        params = sampling_params(body, len(tokens), body.max_tokens, "prompt")
        echo = (prompt if isinstance(prompt, str) else llm.tokenizer.decode(tokens)) if body.echo else ""
        if echo and body.logprobs is not None:  # the prompt's own logprobs too (what evaluation harnesses score)
            params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
        return await respond(request, body, tokens, params, "completion", echo=echo)

    @app.get("/metrics")
    async def prometheus() -> Response:
        await hub.fresh_snapshot()
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/rosechat/kv")
    async def kv_map() -> dict[str, Any]:
        await hub.fresh_snapshot()
        snap = hub.kv_snapshot()
        if snap is None:
            raise APIError(503, "no cache snapshot yet", code="not_ready")
        return {"num_blocks": snap.num_blocks, "block_size": snap.block_size, "state": list(snap.state),
                "state_names": ["free", "cached", "used", "null"], "refcount": list(snap.refcount),
                "group": list(snap.group), "group_names": list(snap.group_names),
                "owners": [list(o) for o in snap.owners], "used_blocks": snap.used_blocks,
                "cached_blocks": snap.cached_blocks, "free_blocks": snap.free_blocks,
                "shared_blocks": snap.shared_blocks, "blocks_saved": snap.blocks_saved,
                "num_running": snap.num_running, "num_waiting": snap.num_waiting,
                "prefix_cache_queries": snap.prefix_cache_queries, "prefix_cache_hits": snap.prefix_cache_hits,
                "hit_rate": snap.hit_rate, "cow_copies": snap.cow_copies, "preemptions": snap.preemptions,
                "tokens_per_s": snap.tokens_per_s, "constrained": list(snap.constrained),
                "spec_drafts": snap.spec_drafts, "spec_draft_tokens": snap.spec_draft_tokens,
                "spec_accepted_tokens": snap.spec_accepted_tokens,
                "spec_accepted_per_pos": list(snap.spec_accepted_per_pos),
                # since the previous snapshot: blocks that held guesses as they were checked, blocks rollbacks gave back
                "spec_guess_blocks": list(snap.spec_guess_blocks),
                "spec_returned_blocks": list(snap.spec_returned_blocks),
                "spec_recent_guesses": snap.spec_recent_guesses, "spec_recent_rejected": snap.spec_recent_rejected}

    app.add_middleware(Guard, api_key=s.api_key, max_body_bytes=s.max_body_bytes)
    return app
