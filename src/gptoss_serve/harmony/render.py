"""A ``RenderRequest`` -> Harmony prompt tokens ending with ``<|start|>assistant``.

The messages are rendered by openai-harmony (through ``adapter``); two things the library
does not do are done here: our chain-of-thought drop rule, and the ``# Response Formats``
section of the developer message (see docs/responses-api.md, "Harmony: what the prompt must be").

The library renders a conversation message by message: a prompt is its header (the system
message and the developer message) followed by each history message's own tokens and
``<|start|>assistant``. An agent sends the same header and the same history again with every
turn (a Codex CLI turn: ~6k tokens of instructions and tools and a history growing by a few
thousand tokens a turn; the render costs ~1 ms per 1k tokens and holds the GIL), so the
header's and each history message's tokens are kept, keyed by a digest of what they render
from, and a prompt renders only what it has new (``HEADERS``, ``ITEMS``: memory bounded by
tokens, least recently used first out). The tokens are those of one whole render
(``tests/test_harmony_render_cache.py`` checks it).
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
from collections.abc import Sequence

from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import (
    Compaction,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    Reasoning,
    RenderRequest,
    ResponseFormat,
)
from gptoss_serve.harmony.token_lru import TokenLru

# Folded into the developer message's instructions instead of rendered in place.
_INSTRUCTION_ROLES = ("system", "developer")
# What a compaction's summary is rendered after, in the user message that carries it.
COMPACTION_INTRO = (
    "The conversation so far was compacted: the items before this point were replaced by the "
    "summary below, written to continue from. Continue the conversation from it.\n\n"
)


# The renders kept (4 bytes a token): headers (a Codex CLI's is ~6k tokens) and history items.
HEADERS = TokenLru(1 << 20)
ITEMS = TokenLru(1 << 22)


def render_prompt(request: RenderRequest) -> list[int]:
    """Prompt tokens for the next assistant turn of ``request``."""
    token_ids = list(_header(request))
    for item in _visible_items(request.items):
        token_ids.extend(_item_tokens(item))
    token_ids.extend(_assistant_start())
    return token_ids


def render_item(item: Item) -> list[int]:
    """The tokens of one history item as ``render_prompt`` renders it in a prompt (its own
    message: the same tokens whatever the items around it)."""
    return list(_item_tokens(item))


def _header(request: RenderRequest) -> array.array:
    """The system message and the developer message (if any) of ``request``'s prompt."""
    instructions = _instructions(request)
    # Folded system/developer messages that are all empty still make a developer message.
    has_developer = (
        instructions is not None or bool(request.tools) or request.response_format is not None
    )
    instructions = instructions or None
    # `commentary` is where function calls go; without tools the model should not use it.
    channels = ("analysis", "commentary", "final") if request.tools else ("analysis", "final")
    tools = [(t.name, t.description, t.parameters, t.namespace) for t in request.tools]
    namespaces = {namespace.name: namespace.description for namespace in request.namespaces}
    fmt = request.response_format
    response_format = fmt and [fmt.name, fmt.description, fmt.schema]
    what = [instructions, request.reasoning_effort, request.today.isoformat(), channels,
            has_developer, tools, namespaces, response_format]  # fmt: skip
    key = _digest(json.dumps(what, ensure_ascii=True))
    kept = HEADERS.get(key)
    if kept is not None:
        return kept
    token_ids = adapter.render_completion_prompt(
        [],
        reasoning_effort=request.reasoning_effort,
        today=request.today,
        channels=channels,
        has_developer=has_developer,
        instructions=instructions,
        tools=[adapter.ToolSpec(*tool) for tool in tools],
        namespace_descriptions=namespaces,
    )[: -len(_assistant_start())]
    if fmt is not None:
        token_ids = _insert_response_format(token_ids, fmt)
    return HEADERS.setdefault(key, token_ids)


def _item_tokens(item: Item) -> array.array:
    spec = _message_spec(item)
    fields = (spec.role, spec.text, spec.author_name, spec.channel, spec.recipient,
              spec.content_type)  # fmt: skip
    key = _digest(json.dumps(fields, ensure_ascii=True))
    kept = ITEMS.get(key)
    if kept is not None:
        return kept
    return ITEMS.setdefault(key, adapter.render_message(spec))


@functools.cache
def _assistant_start() -> tuple[int, ...]:
    """``<|start|>assistant``: what a prompt ends with."""
    return (adapter.special_token_id("<|start|>"), *adapter.encode("assistant"))


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("ascii"), digest_size=16).digest()


def _instructions(request: RenderRequest) -> str | None:
    """``request.instructions`` then the system/developer messages' texts; None if there are
    none (an empty string means system/developer messages exist, all empty: the developer
    message still renders, as the rule says)."""
    folded = [
        item.text
        for item in request.items
        if isinstance(item, Message) and item.role in _INSTRUCTION_ROLES
    ]
    if not request.instructions and not folded:
        return None
    parts = [request.instructions or "", *folded]
    return "\n\n".join(part for part in parts if part)


def _visible_items(items: Sequence[Item]) -> list[Item]:
    """Drop folded system/developer messages, every Reasoning before the last final answer
    (the model saw that analysis in an earlier turn, which is over; reasoning after it belongs
    to the turn in progress, a tool loop, and is kept), and what a compaction replaced."""
    last_final = max(
        (index for index, item in enumerate(items) if is_final_answer(item)), default=-1
    )
    hidden = compacted_away(items)
    return [
        item
        for index, item in enumerate(items)
        if not (isinstance(item, Reasoning) and index < last_final)
        and not (isinstance(item, Message) and item.role in _INSTRUCTION_ROLES)
        and index not in hidden
    ]


def compacted_away(items: Sequence[Item]) -> frozenset[int]:
    """Indices of the items the last Compaction stands in for: every item before it but the
    user messages (which a compaction keeps, as ``/v1/responses/compact`` lists them before
    its item) and the system/developer ones (the instructions). A client that sends its whole
    history back after a compaction (``input += output``) gets the prompt of one that kept
    only what the compaction left."""
    last = max(
        (index for index, item in enumerate(items) if isinstance(item, Compaction)), default=0
    )
    return frozenset(
        index for index, item in enumerate(items[:last]) if not kept_by_compaction(item)
    )


def kept_by_compaction(item: Item) -> bool:
    """A user message, or a system/developer one (the instructions): a compaction keeps it."""
    return isinstance(item, Message) and item.role in ("user", *_INSTRUCTION_ROLES)


def is_final_answer(item: Item) -> bool:
    """An assistant answer: the reasoning before the last one drops out of a prompt."""
    return (
        isinstance(item, Message) and item.role == "assistant" and item.channel in ("final", None)
    )


def _message_spec(item: Item) -> adapter.MessageSpec:
    match item:
        case Message(role="assistant"):
            return adapter.MessageSpec("assistant", item.text, channel=item.channel or "final")
        case Message():
            return adapter.MessageSpec(item.role, item.text)
        case Reasoning():
            return adapter.MessageSpec("assistant", item.text, channel="analysis")
        case Compaction():
            return adapter.MessageSpec("user", COMPACTION_INTRO + item.text)
        case FunctionCall():
            return adapter.MessageSpec(
                "assistant",
                item.arguments,
                channel="commentary",
                recipient=item.recipient,
                content_type="<|constrain|>json",
            )
        case FunctionCallOutput():
            return adapter.MessageSpec(
                "tool",
                item.output,
                author_name=item.author,
                channel="commentary",
                recipient="assistant",
            )
    raise TypeError(f"not a conversation item: {item!r}")


def _response_format_section(response_format: ResponseFormat) -> str:
    """The ``# Response Formats`` text (the schema as compact JSON, as in the Harmony guide)."""
    lines = ["# Response Formats", "", f"## {response_format.name}", ""]
    if response_format.description:
        lines.append(f"// {response_format.description}")
    lines.append(json.dumps(response_format.schema, separators=(",", ":")))
    return "\n".join(lines)


def _insert_response_format(token_ids: list[int], response_format: ResponseFormat) -> list[int]:
    """Splice the section in just before the ``<|end|>`` that closes the developer message
    (the library has no API for it). Special tokens cannot come from user text, so the first
    ``<|end|>`` after ``<|start|>developer`` is the one."""
    end_index = _developer_end_index(token_ids)
    section = _response_format_section(response_format)
    # A blank line separates it from instructions/tools; an empty message needs none.
    if token_ids[end_index - 1] != adapter.special_token_id("<|message|>"):
        section = "\n\n" + section
    return token_ids[:end_index] + adapter.encode(section) + token_ids[end_index:]


def _developer_end_index(token_ids: list[int]) -> int:
    start_id = adapter.special_token_id("<|start|>")
    header = [start_id, *adapter.encode("developer"), adapter.special_token_id("<|message|>")]
    for index, token_id in enumerate(token_ids):
        if token_id == start_id and token_ids[index : index + len(header)] == header:
            return token_ids.index(adapter.special_token_id("<|end|>"), index)
    raise ValueError("the rendered prompt has no developer message")
