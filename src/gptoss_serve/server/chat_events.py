"""Chat Completions objects from a Responses run: pure functions of the Responses events (the
``chat.completion.chunk``s of a stream) and of the final response object (the
``chat.completion``).

The reasoning travels as ``reasoning_content`` (a field the official API does not have, which
vLLM and the clients built on it read); the answer's text as ``content``; function calls as
``tool_calls``, indexed 0, 1, ... in the order the model made them.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from gptoss_serve.server.events import EventLogprobs
from gptoss_serve.server.stop_sequences import StopSequences

FINISH_REASONS = {"completed": "stop", "incomplete": "length"}


@dataclass
class ChatStreamState:
    """One choice's stream: the completion's id, creation time and model (the same in every
    choice's state) and the choice's own index, tool-call numbering and stop sequences."""

    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{secrets.token_hex(16)}")
    created: int = field(default_factory=lambda: int(time.time()))
    index: int = 0  # the choice's
    tool_indices: dict[int, int] = field(default_factory=dict)  # output_index -> tool index
    stops: StopSequences | None = None  # the request's stop sequences, if any


def chunks_for(state: ChatStreamState, event: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks a Responses event becomes (most become none)."""
    handler = _HANDLERS.get(event["type"])
    return [] if handler is None else handler(state, event)


def _started(state: ChatStreamState, _: dict[str, Any]) -> list[dict[str, Any]]:
    return [_chunk(state, {"role": "assistant", "content": ""})]


def _reasoning_delta(state: ChatStreamState, event: dict[str, Any]) -> list[dict[str, Any]]:
    return [_chunk(state, {"reasoning_content": event["delta"]})]


def _text_delta(state: ChatStreamState, event: dict[str, Any]) -> list[dict[str, Any]]:
    text = event["delta"] if state.stops is None else state.stops.feed(event["delta"])
    logprobs = event.get("logprobs")
    if not text and not logprobs:  # held back (it may begin a stop sequence) or after one
        return []
    chosen = {"content": _with_bytes(logprobs)} if logprobs else None
    return [_chunk(state, {"content": text}, logprobs=chosen)]


def _item_added(state: ChatStreamState, event: dict[str, Any]) -> list[dict[str, Any]]:
    item = event["item"]
    if item["type"] != "function_call":
        return []
    index = state.tool_indices[event["output_index"]] = len(state.tool_indices)
    call = {"index": index, "id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": ""}}  # fmt: skip
    return [_chunk(state, {"tool_calls": [call]})]


def _arguments_delta(state: ChatStreamState, event: dict[str, Any]) -> list[dict[str, Any]]:
    call = {"index": state.tool_indices[event["output_index"]],
            "function": {"arguments": event["delta"]}}  # fmt: skip
    return [_chunk(state, {"tool_calls": [call]})]


def _ended(state: ChatStreamState, event: dict[str, Any]) -> list[dict[str, Any]]:
    response = event["response"]
    held = "" if state.stops is None else state.stops.flush()  # it never became a stop
    chunks = [_chunk(state, {"content": held})] if held else []
    chunks.append(_chunk(state, {}, finish_reason=finish_reason(response)))
    return chunks


def usage_chunk(state: ChatStreamState, responses: list[dict[str, Any]]) -> dict[str, Any]:
    """The last chunk of a stream that asked for ``include_usage``: all choices' usage."""
    return {**_head(state), "choices": [], "usage": usage(responses)}


def _failed(_: ChatStreamState, event: dict[str, Any]) -> list[dict[str, Any]]:
    """An error object in the stream, as the official API sends one mid-stream."""
    error = event["response"].get("error") or {}
    return [{"error": {"message": error.get("message", "generation failed"),
                       "type": "server_error", "param": None,
                       "code": error.get("code", "server_error")}}]  # fmt: skip


_HANDLERS = {
    "response.created": _started,
    "response.reasoning_text.delta": _reasoning_delta,
    "response.output_text.delta": _text_delta,
    "response.output_item.added": _item_added,
    "response.function_call_arguments.delta": _arguments_delta,
    "response.completed": _ended,
    "response.incomplete": _ended,
    "response.failed": _failed,
}


def completion(
    state: ChatStreamState, choices: list[dict[str, Any]], responses: list[dict[str, Any]]
) -> dict[str, Any]:
    """The ``chat.completion`` of the choices (``completion_choice`` of each finished response)."""
    return {**_head(state, "chat.completion"), "choices": choices, "usage": usage(responses)}


def completion_choice(
    state: ChatStreamState, response: dict[str, Any], logprobs: bool
) -> dict[str, Any]:
    """A completion's choice from its finished (completed or incomplete) response."""
    content, reasoning, tool_calls, entries = "", "", [], []
    for item in response["output"]:
        if item["type"] == "reasoning":
            reasoning += "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            for part in item["content"]:
                content += part["text"]
                entries += part.get("logprobs") or []
        elif item["type"] == "function_call":
            tool_calls.append({"id": item["call_id"], "type": "function",
                               "function": {"name": item["name"],
                                            "arguments": item["arguments"]}})  # fmt: skip
    if state.stops is not None:
        content = state.stops.cut(content)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if tool_calls and not content else content,
        "refusal": None,
        "annotations": [],
        "reasoning_content": reasoning or None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": state.index,
        "message": message,
        "finish_reason": finish_reason(response),
        "logprobs": {"content": entries, "refusal": None} if logprobs else None,
    }


def finish_reason(response: dict[str, Any]) -> str:
    if response["status"] == "completed" and any(
        item["type"] == "function_call" for item in response["output"]
    ):
        return "tool_calls"
    return FINISH_REASONS[response["status"]]


def usage(responses: list[dict[str, Any]]) -> dict[str, Any]:
    """The choices' usage: their prompt once (the first choice's count, and what of it came
    from the cache), the output tokens of all."""
    prompt = responses[0]["usage"]
    output = sum(response["usage"]["output_tokens"] for response in responses)
    reasoning = sum(
        response["usage"]["output_tokens_details"]["reasoning_tokens"] for response in responses
    )
    return {
        "prompt_tokens": prompt["input_tokens"],
        "completion_tokens": output,
        "total_tokens": prompt["input_tokens"] + output,
        "prompt_tokens_details": {"cached_tokens": prompt["input_tokens_details"]["cached_tokens"]},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def _head(state: ChatStreamState, kind: str = "chat.completion.chunk") -> dict[str, Any]:
    return {"id": state.id, "object": kind, "created": state.created, "model": state.model}


def _chunk(
    state: ChatStreamState,
    delta: dict[str, Any],
    *,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    entry = {"index": state.index, "delta": delta, "finish_reason": finish_reason,
             "logprobs": logprobs}  # fmt: skip
    return {**_head(state), "choices": [entry]}


def _with_bytes(logprobs: EventLogprobs) -> list[dict[str, Any]]:
    """A text delta's log-probability entries as chat's, each with its token's ``bytes``,
    which the Responses event carries beside its JSON (a token that cuts a UTF-8 sequence has
    its bytes only there: its text holds U+FFFD)."""
    return list(logprobs.with_bytes)
