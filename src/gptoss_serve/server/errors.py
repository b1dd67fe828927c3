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

    def __reduce__(self) -> tuple:
        """Pickled whole (a render worker's 400 crosses a process boundary): Exception's own
        pickling would call the constructor with the message alone."""
        return (self.__class__, (self.status_code, self.message), dict(self.__dict__))

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


def too_large(max_bytes: int) -> APIError:
    return APIError(
        413, f"The request body exceeds this server's limit of {max_bytes} bytes.",
        code="request_too_large",
    )  # fmt: skip


_UNION_TAG_ERRORS = ("union_tag_invalid", "union_tag_not_found")


def json_path(body: Any, loc: tuple, kind: str = "") -> str | None:
    """pydantic loc -> ``a.b[0].c``, keeping only the parts that index into ``body``.

    A key absent from the body is kept only when it is the missing one; a bad
    discriminator points at the object's ``type``.
    """
    parts: list[str | int] = []
    node = body
    for position, key in enumerate(loc):
        is_last = position == len(loc) - 1
        if isinstance(node, dict) and isinstance(key, str):
            if key in node:
                parts.append(key)
                node = node[key]
            elif is_last and kind == "missing":
                parts.append(key)
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            parts.append(key)
            node = node[key]
        # anything else is a union-branch label such as 'str' or 'list[...]': skip it
    if kind in _UNION_TAG_ERRORS and isinstance(node, dict):
        parts.append("type")
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or None


_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "json_invalid": "invalid_json",
    "invalid_json_schema": "invalid_json_schema",  # protocol.check_json_schema
}
_MESSAGES = {
    "missing": "Missing required parameter: '{param}'.",
    "extra_forbidden": "Unknown parameter: '{param}'.",
    "union_tag_invalid": "Invalid value for '{param}': unsupported type.",
}


def _param(body: Any, error: dict[str, Any]) -> str | None:
    where, *rest = error["loc"]
    if where != "body":  # query or path parameters
        return ".".join(str(part) for part in rest) or None
    return json_path(body, tuple(rest), error.get("type", ""))


def _rank(body: Any, error: dict[str, Any]) -> tuple[bool, int]:
    # The most specific problem: a wrong `type` first (it explains the errors of every branch
    # of a union), then the one whose path reaches deepest into the request.
    param = _param(body, error) or ""
    return param.endswith(".type") or param == "type", len(param)


def from_validation_error(error: RequestValidationError, body: Any) -> APIError:
    errors = list(error.errors())
    first = max(errors, key=lambda e: _rank(body, e))
    kind = first.get("type", "")
    whole_body = first["loc"] == ("body",)
    if first["loc"][:1] == ("body",) and (
        kind == "json_invalid" or not isinstance(body, dict) or whole_body
    ):
        detail = "the request body must be a JSON object"
        if kind == "json_invalid":
            detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        elif isinstance(body, dict):  # a JSON object, not sent as one (FastAPI did not parse it)
            detail = "send it with the header 'Content-Type: application/json'"
        return bad_request(
            f"We could not parse the JSON body of your request: {detail}", None, "invalid_json"
        )
    param = _param(body, first)
    bound = _out_of_range(param, first)
    if bound is not None:
        return bad_request(*bound)
    template = _MESSAGES.get(kind, "Invalid value for '{param}': {msg}.")
    message = template.format(param=param, msg=first.get("msg", "invalid").rstrip("."))
    context = first.get("ctx") or {}
    if kind == "union_tag_invalid" and "tag" in context and "expected_tags" in context:
        # The tag as JSON (ASCII: a lone surrogate would not encode), and what is served.
        message = (f"Invalid value for '{param}': {json.dumps(str(context['tag']))} is not a "
                   f"supported type (supported: {context['expected_tags']}).")  # fmt: skip
    return bad_request(message, param, _CODES.get(kind, "invalid_value"))


# pydantic's number bounds -> the real API's words: (which side, its comparison).
_BOUNDS = {
    "greater_than_equal": ("below", "min", "ge", ">="),
    "greater_than": ("below", "min", "gt", ">"),
    "less_than_equal": ("above", "max", "le", "<="),
    "less_than": ("above", "max", "lt", "<"),
}


def _out_of_range(param: str | None, error: dict[str, Any]) -> tuple[str, str | None, str] | None:
    """(message, param, code) of a number outside its bounds, as the real API words it:
    ``Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 16, but
    got 10 instead.`` (``integer_below_min_value``; ``decimal_...`` for a float)."""
    side = _BOUNDS.get(error.get("type", ""))
    value = error.get("input")
    if side is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    where, extreme, key, comparison = side
    limit = error.get("ctx", {}).get(key)
    kind = "integer" if isinstance(limit, int) else "decimal"  # the field's type, not the value's
    message = (
        f"Invalid '{param}': {kind} {where} {extreme}imum value. Expected a value "
        f"{comparison} {_number(limit)}, but got {_number(value)} instead."
    )
    return message, param, f"{kind}_{where}_{extreme}_value"


def _number(value: Any) -> Any:
    """2.0 as 2, 2.5 as 2.5 (as the real API prints bounds and values)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


async def _read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


class ErrorResponse(JSONResponse):
    """An error body as JSON, every non-ASCII character escaped: a message may quote the
    client's own text, lone UTF-16 surrogates included, which UTF-8 cannot encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")  # fmt: skip


def error_response(error: APIError) -> ErrorResponse:
    return ErrorResponse(error.body(), status_code=error.status_code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_error(error, await _read_json(request)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            error.status_code
        )
        return error_response(APIError(error.status_code, str(error.detail), code=code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        # Starlette runs this outside every middleware: the request id comes from the state
        request_id = getattr(request.state, "request_id", None)
        logger.exception("unhandled error (%s %s, %s)", request.method, request.url.path,
                         request_id)  # fmt: skip
        api_error = APIError(
            500, "The server had an error while processing your request.",
            code="server_error", error_type="server_error",
        )  # fmt: skip
        response = error_response(api_error)
        if request_id is not None:
            response.headers["x-request-id"] = request_id
        return response
