"""Streaming events as functions of (state, parser event) -> events, with no I/O.

The state is passed explicitly and these functions are its only writers. They produce the
exact official sequence: ``sequence_number`` from 0 by 1; ``output_index`` dense and the
same in an item's added/delta/done events; ``content_index`` 0 for the one part per item;
the same ``id``/``call_id`` in every event and in the final object.

How Harmony messages map to output items:
  analysis (or an unknown channel)       -> reasoning item
  final, no channel, commentary without a recipient (a preamble) -> message item
  any message with a recipient (``functions.name``, ``namespace.name``) -> function_call item
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gptoss_serve.harmony.conversation import (
    ContentDelta,
    MessageDone,
    MessageStarted,
    ParseEvent,
    split_recipient,
)
from gptoss_serve.server.objects import (
    CompactionOutput,
    FunctionCallOutputObject,
    MessageOutput,
    OutputTextPart,
    ReasoningOutput,
    ReasoningTextPart,
    ResponseObject,
    new_id,
)
from gptoss_serve.server.reasoning_seal import seal

Event = dict[str, Any]


@dataclass
class OpenItem:
    kind: str  # "reasoning" | "message" | "function_call"
    output_index: int
    item_id: str
    channel: str | None
    name: str = ""
    namespace: str | None = None  # a call's, when it goes to a `namespace` tool's function
    call_id: str = ""
    # The text so far, as its deltas: appending to one string copies it every token, which
    # for a 30k-token reasoning was 0.26 s of the event loop (quadratic in the length).
    parts: list[str] = field(default_factory=list)
    # A message's tokens' log-probabilities (server/logprobs.py entries), when asked for.
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class StreamState:
    response: ResponseObject
    sequence_number: int = 0
    current: OpenItem | None = None
    # Reasoning items carry their text as encrypted_content too (reasoning_seal.py).
    seal_reasoning: bool = False
    # Log-probabilities of content tokens whose text no delta has carried yet (a token may
    # end inside a UTF-8 sequence: its text comes with the next token's delta).
    pending_logprobs: list[dict[str, Any]] = field(default_factory=list)

    def event(self, event_type: str, **fields: Any) -> Event:
        event = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event


def item_kind(channel: str | None, recipient: str | None) -> str:
    if recipient and recipient != "assistant":
        return "function_call"
    if channel in (None, "final", "commentary"):
        return "message"
    return "reasoning"


def start(state: StreamState) -> list[Event]:
    """``response.created`` then ``response.in_progress``, both with the in-progress object."""
    snapshot = state.response.dump()
    return [
        state.event("response.created", response=snapshot),
        state.event("response.in_progress", response=snapshot),
    ]


def compaction(state: StreamState, item: CompactionOutput) -> list[Event]:
    """The summary a response made of its conversation before it answered, as its first
    output item: ``response.output_item.added`` and ``.done``, both with the whole item."""
    index = len(state.response.output)
    state.response.output.append(item)
    data = item.model_dump(mode="json")
    return [
        state.event("response.output_item.added", output_index=index, item=data),
        state.event("response.output_item.done", output_index=index, item=data),
    ]


def takes_logprobs(state: StreamState) -> bool:
    """Whether the open item is a message, the only kind whose tokens' log-probabilities go
    out (reasoning and function-call text carries none)."""
    return state.current is not None and state.current.kind == "message"


def add_logprobs(state: StreamState, entry: dict[str, Any]) -> None:
    """A content token of the open message's log-probabilities (``logprobs.logprob_entry``;
    ``takes_logprobs`` holds), fed before the parse events of the same token: the message's
    next text delta carries them."""
    state.pending_logprobs.append(entry)


def on_parse_event(state: StreamState, parsed: ParseEvent) -> list[Event]:
    if isinstance(parsed, MessageStarted):
        return _open(state, parsed)
    if isinstance(parsed, ContentDelta):
        return _delta(state, parsed.text)
    if isinstance(parsed, MessageDone):
        return _close(state, "completed")
    raise TypeError(f"unknown parse event {parsed!r}")


def _open(state: StreamState, started: MessageStarted) -> list[Event]:
    events = _close(state, "incomplete") if state.current else []
    kind = item_kind(started.channel, started.recipient)
    prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
    item = OpenItem(kind, len(state.response.output), new_id(prefix), started.channel)
    if kind == "function_call":
        declared = frozenset(t.name for t in state.response.tools if t.type == "namespace")
        item.namespace, item.name = split_recipient(started.recipient or "", declared)
        item.call_id = new_id("call")
    state.current = item
    state.response.output.append(_item_object(item, "in_progress", with_part=False))
    events = [
        *events,
        state.event(
            "response.output_item.added",
            output_index=item.output_index,
            item=_item_object(item, "in_progress", with_part=False).model_dump(mode="json"),
        ),
    ]
    if kind != "function_call":
        events.append(
            state.event(
                "response.content_part.added", **_where(item), part=_part(item).model_dump()
            )
        )
    return events


def _delta(state: StreamState, text: str) -> list[Event]:
    item = state.current
    if item is None or not text:
        return []
    item.parts.append(text)
    if item.kind == "function_call":
        return [
            state.event(
                "response.function_call_arguments.delta",
                item_id=item.item_id,
                output_index=item.output_index,
                delta=text,
            )
        ]
    if item.kind == "reasoning":
        return [state.event("response.reasoning_text.delta", **_where(item), delta=text)]
    logprobs, state.pending_logprobs = state.pending_logprobs, []
    item.logprobs += logprobs
    return [
        state.event(
            "response.output_text.delta", **_where(item), delta=text,
            logprobs=EventLogprobs(logprobs),
        )
    ]  # fmt: skip


def _close(state: StreamState, status: str) -> list[Event]:
    item = state.current
    if item is None:
        return []
    state.current = None
    item.logprobs += state.pending_logprobs  # tokens of a UTF-8 sequence the end cut off
    state.pending_logprobs = []
    final = _item_object(item, status, with_part=True, sealed=state.seal_reasoning)
    state.response.output[item.output_index] = final
    events: list[Event] = []
    if item.kind == "function_call":
        events.append(
            state.event(
                "response.function_call_arguments.done",
                item_id=item.item_id,
                output_index=item.output_index,
                name=item.name,
                arguments=item.text,
            )
        )
    else:
        text_done = (
            state.event("response.reasoning_text.done", **_where(item), text=item.text)
            if item.kind == "reasoning"
            else state.event(
                "response.output_text.done",
                **_where(item),
                text=item.text,
                logprobs=EventLogprobs(item.logprobs),
            )
        )
        part = _part(item).model_dump()
        events += [text_done, state.event("response.content_part.done", **_where(item), part=part)]
    events.append(
        state.event(
            "response.output_item.done",
            output_index=item.output_index,
            item=final.model_dump(mode="json"),
        )
    )
    return events


def finish(state: StreamState) -> list[Event]:
    """Close an item cut off mid-way (incomplete), then the one terminal event.

    The caller has set the response's status, usage and error/incomplete details.
    """
    events = _close(state, "incomplete")
    terminal = {
        "completed": "response.completed",
        "incomplete": "response.incomplete",
        "failed": "response.failed",
    }[state.response.status]
    return [*events, state.event(terminal, response=state.response.dump())]


def cancel(state: StreamState) -> list[Event]:
    """A cancelled background response: the item cut off mid-way closes as incomplete, and no
    terminal event follows (the stream ends; the object's status says ``cancelled``)."""
    return _close(state, "incomplete")


def _where(item: OpenItem) -> dict[str, Any]:
    return {"item_id": item.item_id, "output_index": item.output_index, "content_index": 0}


class EventLogprobs(list):
    """A text event's log-probabilities as it carries them, without ``bytes`` (the SDK's
    types), and the whole entries beside them (``with_bytes``, not in the JSON): the chat
    stream (chat_events.py) gives each token's bytes, which a token that cuts a UTF-8
    sequence has only there (its text holds U+FFFD)."""

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        super().__init__(
            {
                "token": entry["token"],
                "logprob": entry["logprob"],
                "top_logprobs": [
                    {"token": top["token"], "logprob": top["logprob"]}
                    for top in entry["top_logprobs"]
                ],
            }
            for entry in entries
        )
        self.with_bytes = entries


def _part(item: OpenItem) -> OutputTextPart | ReasoningTextPart:
    if item.kind == "reasoning":
        return ReasoningTextPart(text=item.text)
    return OutputTextPart(text=item.text, logprobs=item.logprobs)


def _item_object(item: OpenItem, status: str, *, with_part: bool, sealed: bool = False):
    """The item as it appears in output_item.added (no parts yet) or done / the final object
    (``sealed``: a reasoning item with its encrypted_content)."""
    if item.kind == "function_call":
        return FunctionCallOutputObject(
            id=item.item_id,
            call_id=item.call_id,
            name=item.name,
            namespace=item.namespace,
            arguments=item.text if with_part else "",
            status=status,
        )
    if item.kind == "reasoning":
        content = [ReasoningTextPart(text=item.text)] if with_part else []
        encrypted = seal(item.text) if with_part and sealed else None
        return ReasoningOutput(id=item.item_id, content=content, status=status,
                               encrypted_content=encrypted)  # fmt: skip
    content = [_part(item)] if with_part else []
    phase = "commentary" if item.channel == "commentary" else "final_answer"
    return MessageOutput(id=item.item_id, content=content, status=status, phase=phase)
