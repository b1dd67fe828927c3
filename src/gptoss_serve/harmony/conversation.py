"""The conversation as Harmony sees it: plain dataclasses, independent of the HTTP protocol.

The server converts Responses API input into these; ``render.py`` turns them into prompt
tokens; ``parse.py`` turns generated tokens back into ``ParseEvent``s. No torch, no engine.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["user", "assistant", "system", "developer"]
# The Harmony namespace of the Responses API's top-level function tools: the model calls
# ``functions.{name}``. A ``namespace`` tool's functions are called ``{namespace}.{name}``.
FUNCTIONS = "functions"


def recipient(namespace: str, name: str) -> str:
    """What the model writes after ``to=`` to call ``name`` of ``namespace`` (and the author of
    its result): ``functions.f``, ``ns.f``. ``split_recipient`` reads it back."""
    return f"{namespace}.{name}"


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema of the arguments object
    strict: bool = False
    namespace: str = FUNCTIONS

    @property
    def recipient(self) -> str:
        """What the model writes after ``to=`` to call it."""
        return recipient(self.namespace, self.name)


@dataclass(frozen=True)
class ToolNamespace:
    """A namespace of tools besides ``functions`` (a ``namespace`` tool), as the developer
    message introduces it: its name and the description rendered above its functions."""

    name: str
    description: str | None = None


def split_recipient(recipient: str, namespaces: frozenset[str]) -> tuple[str | None, str]:
    """(namespace, name) of a call's recipient: ``functions.f`` is (None, "f") as the API
    reports a top-level function; ``ns.f`` for a declared namespace ``ns`` is ("ns", "f"); any
    other recipient (a tool nobody declared) is (None, the recipient as written)."""
    prefix, dot, name = recipient.partition(".")
    if dot and prefix == FUNCTIONS:
        return None, name
    if dot and prefix in namespaces:
        return prefix, name
    return None, recipient


@dataclass(frozen=True)
class ResponseFormat:
    """``text.format`` of type json_schema: rendered as a ``# Response Formats`` section."""

    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool = False


# -- history items ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """A message of the conversation. An assistant message's channel is ``final`` for an
    answer and ``commentary`` for a preamble (a commentary message without recipient).
    System and developer messages are folded into the developer message's instructions."""

    role: Role
    text: str
    channel: str | None = None


@dataclass(frozen=True)
class FunctionCall:
    """An assistant call: rendered as a commentary message to ``{namespace}.{name}``
    with content type ``<|constrain|>json``."""

    call_id: str
    name: str
    arguments: str
    namespace: str = FUNCTIONS

    @property
    def recipient(self) -> str:
        return recipient(self.namespace, self.name)


@dataclass(frozen=True)
class FunctionCallOutput:
    """A tool result: rendered as a message from ``{namespace}.{name}`` to assistant on
    commentary. ``name`` and ``namespace`` are resolved by the caller from the matching
    FunctionCall."""

    call_id: str
    name: str
    output: str
    namespace: str = FUNCTIONS

    @property
    def author(self) -> str:
        return recipient(self.namespace, self.name)


@dataclass(frozen=True)
class Reasoning:
    """An assistant analysis (chain-of-thought) message."""

    text: str


@dataclass(frozen=True)
class Compaction:
    """A summary of the conversation before it, which stands in for the items it replaced (a
    ``compaction`` item of ``/v1/responses/compact``): rendered as a user message that says
    what it is."""

    text: str


Item = Message | FunctionCall | FunctionCallOutput | Reasoning | Compaction


@dataclass(frozen=True)
class RenderRequest:
    items: tuple[Item, ...]
    instructions: str | None = None
    reasoning_effort: Literal["low", "medium", "high"] = "medium"
    tools: tuple[FunctionTool, ...] = ()  # every callable function, of every namespace
    namespaces: tuple[ToolNamespace, ...] = ()  # those of the tools besides ``functions``
    response_format: ResponseFormat | None = None
    today: dt.date = field(default_factory=dt.date.today)


# -- what the parser reports ------------------------------------------------------------------


@dataclass(frozen=True)
class MessageStarted:
    """The header of a new assistant message is complete; its content follows."""

    channel: str | None
    recipient: str | None  # e.g. "functions.get_weather"; None for a plain message
    content_type: str | None  # e.g. "<|constrain|>json"


@dataclass(frozen=True)
class ContentDelta:
    """New UTF-8-safe text of the message being generated."""

    text: str


@dataclass(frozen=True)
class MessageDone:
    """The message ended (``<|end|>``, ``<|return|>``, ``<|call|>``, or end of generation)."""

    channel: str | None
    recipient: str | None
    content_type: str | None
    text: str


ParseEvent = MessageStarted | ContentDelta | MessageDone
