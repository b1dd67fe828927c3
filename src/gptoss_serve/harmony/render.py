"""A ``RenderRequest`` -> Harmony prompt tokens ending with ``<|start|>assistant``.

The messages are rendered by openai-harmony (through ``adapter``); two things the library
does not do are done here: our chain-of-thought drop rule, and the ``# Response Formats``
section of the developer message (see docs/responses-api.md, "Harmony: what the prompt must be").
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import (
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    Reasoning,
    RenderRequest,
    ResponseFormat,
)

# Folded into the developer message's instructions instead of rendered in place.
_INSTRUCTION_ROLES = ("system", "developer")


def render_prompt(request: RenderRequest) -> list[int]:
    """Prompt tokens for the next assistant turn of ``request``."""
    instructions = _instructions(request)
    has_developer = (
        instructions is not None or bool(request.tools) or request.response_format is not None
    )
    messages = [_message_spec(item) for item in _visible_items(request.items)]
    # `commentary` is where function calls go; without tools the model should not use it.
    channels = ("analysis", "commentary", "final") if request.tools else ("analysis", "final")
    tools = [
        adapter.ToolSpec(t.name, t.description, t.parameters, t.namespace) for t in request.tools
    ]
    namespaces = {namespace.name: namespace.description for namespace in request.namespaces}
    token_ids = adapter.render_completion_prompt(
        messages,
        reasoning_effort=request.reasoning_effort,
        today=request.today,
        channels=channels,
        has_developer=has_developer,
        instructions=instructions or None,
        tools=tools,
        namespace_descriptions=namespaces,
    )
    if request.response_format is not None:
        token_ids = _insert_response_format(token_ids, request.response_format)
    return token_ids


def render_item(item: Item) -> list[int]:
    """The tokens of one history item as ``render_prompt`` renders it in a prompt (its own
    message: the same tokens whatever the items around it)."""
    return adapter.render_message(_message_spec(item))


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
    """Drop folded system/developer messages, and every Reasoning before the last final answer:
    the model saw that analysis in an earlier turn, which is over. Reasoning after it belongs to
    the turn in progress (a tool loop) and is kept."""
    last_final = max(
        (index for index, item in enumerate(items) if is_final_answer(item)), default=-1
    )
    return [
        item
        for index, item in enumerate(items)
        if not (isinstance(item, Reasoning) and index < last_final)
        and not (isinstance(item, Message) and item.role in _INSTRUCTION_ROLES)
    ]


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
