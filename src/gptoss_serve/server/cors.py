"""Cross-origin requests from browser apps (``--allowed-origins``): Starlette's CORS middleware,
with its refused preflights answered in the OpenAI error shape rather than plain text.

Off unless origins are given: a server on loopback that answered every origin would let any web
page the user opens drive the model and read the stored responses. The middleware is the
outermost, so a preflight (which carries no Authorization header) is answered before the API
keys' check, and a 401 still carries the CORS headers that let the page read it.
"""

from __future__ import annotations

import logging

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp

from gptoss_serve.server.errors import APIError, error_response

logger = logging.getLogger(__name__)

ALLOWED_METHODS = ("GET", "POST", "DELETE", "OPTIONS")
MAX_AGE_S = 600  # how long a browser may cache a preflight's answer


def check_origin(origin: str) -> None:
    """``*``, or ``scheme://host[:port]`` without a path (what a browser sends as Origin)."""
    if origin == "*":
        return
    scheme, separator, rest = origin.partition("://")
    if scheme not in ("http", "https") or not separator or not rest or "/" in rest:
        raise ValueError(f"an origin is '*' or scheme://host[:port] without a path, got {origin!r}")


class OpenAICors(CORSMiddleware):
    def __init__(self, app: ASGIApp, origins: tuple[str, ...]) -> None:
        for origin in origins:
            check_origin(origin)
        # Any request header: the SDKs send their own (x-stainless-*, openai-beta, ...).
        super().__init__(
            app, allow_origins=origins, allow_methods=ALLOWED_METHODS, allow_headers=("*",),
            expose_headers=("x-request-id",), max_age=MAX_AGE_S,
        )  # fmt: skip

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        reason = bytes(response.body).decode()  # "Disallowed CORS origin, method"
        logger.info("refused a CORS preflight from %s: %s", request_headers.get("origin"), reason)
        refused = error_response(APIError(400, f"{reason}.", code="cors_not_allowed"))
        for name, value in response.headers.items():
            if name.startswith("access-control-") or name == "vary":
                refused.headers[name] = value
        return refused
