"""Server-sent events as both APIs stream them: one JSON encoder for every event, and the
``text/event-stream`` response (no caching, no proxy buffering) around the formatted blocks."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

logger = logging.getLogger(__name__)

# One encoder for every event (json.dumps with separators builds a new one a call: 6 -> 3 us).
JSON = json.JSONEncoder(separators=(",", ":"))


def sse_response(blocks: AsyncIterator[str]) -> StreamingResponse:
    """``blocks``: whole SSE blocks (``data: ...`` and a blank line). Starlette stops the
    iteration (and so the generation behind it) when the client leaves."""
    return StreamingResponse(
        blocks,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
