"""``x-request-id`` on every answer, as the official API sends it: the SDK shows it as
``response._request_id`` and on its errors as ``request_id``, which is what a user quotes when
something went wrong, and the server logs it beside each request it refuses or fails.

The middleware is the outermost, so 401s, 413s and CORS preflights carry one too. A client's
own ``X-Client-Request-Id`` is not echoed (the official API only logs it); a request id is
always this server's, fresh per request. A 500 (never a client's mistake) is logged with it.
"""

from __future__ import annotations

import logging
import secrets
import time
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

HEADER = b"x-request-id"
# The id of the request being served, for log lines written while serving it ("-": none).
current_request_id: ContextVar[str] = ContextVar("current_request_id", default="-")
# When it arrived (time.monotonic(), before its body was read and checked; None: not served
# through this middleware): the start of ``gptoss_request_prepare_seconds``.
request_received_at: ContextVar[float | None] = ContextVar("request_received_at", default=None)


def new_request_id() -> str:
    return f"req_{secrets.token_hex(16)}"


class RequestIds:
    """Pure ASGI middleware: a fresh id in the context and on the response's headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = request_received_at.set(time.monotonic())
        request_id = new_request_id()
        token = current_request_id.set(request_id)
        # Also in the scope's state: Starlette's 500 handler runs outside every middleware,
        # after this context is gone, and reads it from there (errors.py).
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)
            request_received_at.reset(received)
