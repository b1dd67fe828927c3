"""The request body limit: a body over ``max_bytes`` is answered 413 in the OpenAI error shape.

A declared length over the limit is refused before any byte is read; a body sent without one
(chunked) is counted as it arrives, and its read stops with a 413 once past the limit.
FastAPI's own ``max_body_size`` does the same counting but answers a declared length in plain
text ("Content Too Large"), whatever the app's error handlers say, which the OpenAI SDK cannot
read: hence this middleware.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gptoss_serve.server.errors import error_response, too_large


class BodyLimit:
    """Pure ASGI middleware (it must see the body's messages, which BaseHTTPMiddleware hides)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = too_large(self.max_bytes)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(error)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # the route's body read: errors.py answers it
                    raise HTTPException(413, error.message)
            return message

        await self.app(scope, counted, send)
