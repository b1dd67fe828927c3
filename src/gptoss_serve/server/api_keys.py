"""API-key authentication of the /v1 routes: ``Authorization: Bearer <key>``, as the OpenAI SDK
sends its ``api_key``.

With keys configured (``gptoss-serve serve --api-key``, or ``GPTOSS_SERVE_API_KEY``), a /v1
request without a header, with another scheme, or with a key that is not one of them is
answered 401 in the OpenAI error shape before its body is read (the SDK raises
``openai.AuthenticationError``); the key a client sent is never echoed whole. The liveness
checks and the Prometheus metrics stay open, as vLLM's do, so that probes and scrapers need
no secret. Keys are compared in constant time (``hmac.compare_digest``) against every
configured key, so the time taken says nothing about which one nearly matched.
"""

from __future__ import annotations

import hmac
import logging
import string

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from gptoss_serve.server.errors import APIError, error_response

logger = logging.getLogger(__name__)

API_KEY_ENV = "GPTOSS_SERVE_API_KEY"  # a key from the environment: not in `ps` output
PROTECTED_PREFIX = "/v1"
_KEY_CHARACTERS = frozenset(string.ascii_letters + string.digits + string.punctuation)
_SHOWN = 4  # characters shown at each end of a wrong key (as the official API masks them)


def check_api_key(key: str) -> None:
    """A usable key: 1-512 printable ASCII characters without spaces (what an HTTP header
    carries unchanged). Raises ValueError naming the problem, never the key itself."""
    if not key:
        raise ValueError("an API key must not be empty")
    if len(key) > 512:
        raise ValueError(f"an API key must be at most 512 characters, got {len(key)}")
    if not set(key) <= _KEY_CHARACTERS:
        raise ValueError("an API key must be printable ASCII without spaces")


def masked(key: str) -> str:
    """``sk-a****wxyz``: enough of a wrong key for its owner to recognise it."""
    if len(key) <= 2 * _SHOWN:
        return "*" * len(key)
    return f"{key[:_SHOWN]}{'*' * min(len(key) - 2 * _SHOWN, 16)}{key[-_SHOWN:]}"


def missing_key() -> APIError:
    return APIError(
        401,
        "You didn't provide an API key. You need to provide your API key in an Authorization "
        "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
    )


def wrong_key(sent: str) -> APIError:
    return APIError(
        401, f"Incorrect API key provided: {masked(sent)}.", code="invalid_api_key"
    )  # fmt: skip


def bearer_token(authorization: str | None) -> str | None:
    """The token of ``Bearer <token>`` (the scheme in any case, RFC 7235), else None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def is_valid(token: str, keys: tuple[bytes, ...]) -> bool:
    """Compared with every key (no early exit): constant time in which key matches."""
    sent = token.encode("utf-8", "surrogateescape")
    matches = [hmac.compare_digest(sent, key) for key in keys]
    return any(matches)


class ApiKeyAuth:
    """Pure ASGI middleware: a 401 answers before the route (and its body read) runs."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        for key in keys:
            check_api_key(key)
        if not keys:
            raise ValueError("ApiKeyAuth needs at least one key")
        self.app = app
        self.keys = tuple(key.encode("ascii") for key in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        token = bearer_token(Headers(scope=scope).get("authorization"))
        error = None
        if token is None:
            error = missing_key()
        elif not is_valid(token, self.keys):
            error = wrong_key(token)
        if error is None:
            await self.app(scope, receive, send)
            return
        logger.info("%s %s: 401 (%s)", scope["method"], scope["path"], error.code or "no key")
        response = error_response(error)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def _is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")
