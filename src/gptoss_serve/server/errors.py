"""Every error a client sees has the OpenAI shape: {"error": {message, type, param, code}}.

Validation errors name the field by its JSON path in the request (``input[2].call_id``),
found by walking pydantic's error location through the actual body, so union-branch labels
in the location never leak into ``param``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, param=param, code="not_found")


def json_path(body: Any, loc: tuple) -> str | None:
    """pydantic loc -> ``a.b[0].c``, keeping only the parts that index into ``body``."""
    parts: list[str | int] = []
    node = body
    for position, key in enumerate(loc):
        is_last = position == len(loc) - 1
        if isinstance(node, dict) and isinstance(key, str) and (key in node or is_last):
            parts.append(key)
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            parts.append(key)
            node = node[key]
        # anything else is a union-branch label such as 'str' or 'list[...]': skip it
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or None


_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "json_invalid": "invalid_json",
}


def from_validation_error(error: RequestValidationError, body: Any) -> APIError:
    errors = [e for e in error.errors() if e.get("loc", ("body",))[:1] == ("body",)] or list(
        error.errors()
    )
    # The most specific problem: the one whose path reaches deepest into the body.
    ranked = sorted(errors, key=lambda e: len(json_path(body, tuple(e["loc"][1:])) or ""))
    first = ranked[-1]
    kind = first.get("type", "")
    if kind == "json_invalid" or not isinstance(body, dict):
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        if kind != "json_invalid":
            detail = "the request body must be a JSON object"
        return bad_request(f"We could not parse the JSON body of your request: {detail}", None,
                           "invalid_json")  # fmt: skip
    param = json_path(body, tuple(first["loc"][1:]))
    if kind == "missing":
        message = f"Missing required parameter: '{param}'."
    elif kind == "extra_forbidden":
        message = f"Unknown parameter: '{param}'."
    else:
        message = f"Invalid value for '{param}': {first.get('msg', 'invalid')}."
    return bad_request(message, param, _CODES.get(kind, "invalid_value"))


async def _read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError) -> JSONResponse:
        api_error = from_validation_error(error, await _read_json(request))
        return JSONResponse(api_error.body(), status_code=api_error.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        api_error = APIError(error.status_code, str(error.detail), code=code)
        return JSONResponse(api_error.body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        api_error = APIError(
            500, "The server had an error while processing your request.",
            code="server_error", error_type="server_error",
        )  # fmt: skip
        return JSONResponse(api_error.body(), status_code=500)
