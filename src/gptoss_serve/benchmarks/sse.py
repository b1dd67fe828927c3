"""Server-sent events, decoded line by line (the framing of the WHATWG event-stream format).

An event is ``event:`` and ``data:`` lines ended by a blank line; several ``data:`` lines are
joined with newlines; a line starting with ``:`` is a comment; one space after the colon is
not part of the value. The HTTP client splits the body into lines; this module only frames.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SseEvent:
    event: str | None  # None when the server sent no `event:` line
    data: str


class SseDecoder:
    """Feed lines without their line ending; a blank line returns the event it completed."""

    def __init__(self) -> None:
        self._event: str | None = None
        self._data: list[str] = []

    def feed(self, line: str) -> SseEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            self._event = value
        elif field == "data":
            self._data.append(value)
        # `id:` and `retry:` are for reconnecting browsers; a benchmark does not reconnect.
        return None

    def _dispatch(self) -> SseEvent | None:
        # A blank line with no data line before it ends nothing (the spec drops such events).
        event = SseEvent(self._event, "\n".join(self._data)) if self._data else None
        self._event, self._data = None, []
        return event


def decode_lines(lines: Iterable[str]) -> list[SseEvent]:
    """Every complete event in ``lines``; a final event without its blank line is dropped."""
    decoder = SseDecoder()
    return [event for line in lines if (event := decoder.feed(line)) is not None]
