"""Pure-ASGI middleware in front of every route: API-key check and request-body size limit.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect detection pass through
untouched.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rosechat.server.errors import error_body

OPEN_PATHS = frozenset({"/health"})  # load balancers and the app's probe need no key


class Guard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time: no key guessing by timing
                await _reply(send, 401, "missing or invalid API key (Authorization: Bearer ...)",
                             "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                await _reply(send, 413, f"request body over {self.max_body_bytes} bytes", "body_too_large")
                return
            # Read the body here (bounded, also when chunked), then replay it to the app; later
            # receive() calls go to the server, so the app still sees http.disconnect.
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away before sending its body
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    await _reply(send, 413, f"request body over {self.max_body_bytes} bytes", "body_too_large")
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            body, replayed = b"".join(chunks), False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)


async def _reply(send: Send, status: int, message: str, code: str,
                 extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})
