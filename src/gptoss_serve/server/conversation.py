"""Responses API input <-> the Harmony conversation (harmony.conversation dataclasses).

Also the JSON forms: internal items as stored for ``previous_response_id``, and input items
as listed by ``GET /v1/responses/{id}/input_items`` (shaped like the SDK's ResponseItem).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pydantic import TypeAdapter

from gptoss_serve.harmony.conversation import (
    FUNCTIONS,
    Compaction,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    Reasoning,
)
from gptoss_serve.server.errors import APIError, bad_request
from gptoss_serve.server.objects import new_id
from gptoss_serve.server.protocol import (
    CompactionItem,
    CompactionTrigger,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    InputMessage,
    ItemReference,
    ReasoningItem,
)
from gptoss_serve.server.reasoning_seal import COMPACTION_PREFIX, unseal

_KINDS = {
    "message": Message,
    "function_call": FunctionCall,
    "function_call_output": FunctionCallOutput,
    "reasoning": Reasoning,
    "compaction": Compaction,
}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}
_INPUT_ITEM: TypeAdapter = TypeAdapter(InputItem)


def item_to_json(item: Item) -> dict[str, Any]:
    return {"kind": _KIND_OF[type(item)], **asdict(item)}


def item_from_json(data: dict[str, Any]) -> Item:
    fields = dict(data)
    return _KINDS[fields.pop("kind")](**fields)


def call_names(items: list[Item]) -> dict[str, tuple[str, str]]:
    """call_id -> (function name, namespace), for every call in the conversation so far."""
    return {
        item.call_id: (item.name, item.namespace)
        for item in items
        if isinstance(item, FunctionCall)
    }


class InputConverter:
    """Converts one request's input items, in order, checking references as it goes."""

    def __init__(self, history: list[Item], lookup_item) -> None:
        self.items: list[Item] = []  # new conversation items from this request
        self.listed: list[dict[str, Any]] = []  # input_items as the API lists them
        self._calls = call_names(history)
        self._lookup_item = lookup_item  # item id -> stored output/input item JSON, or None
        # Where a compaction_trigger was (it makes no item): the caller says where it may be.
        self.trigger_param: str | None = None

    def add_text(self, text: str) -> None:
        self._add_message(InputMessage(role="user", content=text), "input")

    def add(self, raw: Any, param: str) -> None:
        if isinstance(raw, ItemReference):
            stored = self._lookup_item(raw.id)
            if stored is None:
                raise APIError(404, f"Item with id '{raw.id}' not found.", param=f"{param}.id",
                               code="not_found")  # fmt: skip
            raw = _parse_stored_item(stored)
        if isinstance(raw, InputMessage):
            self._add_message(raw, param)
        elif isinstance(raw, FunctionCallItem):
            namespace = raw.namespace or FUNCTIONS
            self._calls[raw.call_id] = (raw.name, namespace)
            self.items.append(FunctionCall(raw.call_id, raw.name, raw.arguments, namespace))
            self.listed.append(_listed(raw, "fc"))
        elif isinstance(raw, FunctionCallOutputItem):
            call = self._calls.get(raw.call_id)
            if call is None:
                raise bad_request(
                    f"No tool call found for function call output with call_id {raw.call_id}.",
                    f"{param}.call_id",
                )
            name, namespace = call
            self.items.append(FunctionCallOutput(raw.call_id, name, raw.text(), namespace))
            self.listed.append(_listed(raw, "fco"))
        elif isinstance(raw, ReasoningItem):
            self.items.append(Reasoning(_reasoning_text(raw, param)))
            self.listed.append(_listed(raw, "rs"))
        elif isinstance(raw, CompactionTrigger):
            self.trigger_param = param
        elif isinstance(raw, CompactionItem):
            self.items.append(Compaction(_compaction_summary(raw, param)))
            listed = raw.model_dump(mode="json", exclude_none=True)  # it has no status
            self.listed.append({**listed, "id": raw.id or new_id("cmp")})

    def _add_message(self, raw: InputMessage, param: str) -> None:
        if raw.role != "assistant" and not isinstance(raw.content, str):
            for index, part in enumerate(raw.content):
                if part.type != "input_text":
                    raise bad_request(
                        f"Invalid content type '{part.type}' for a {raw.role} message: "
                        "expected 'input_text'.",
                        f"{param}.content[{index}].type",
                    )
        channel = None
        if raw.role == "assistant":
            channel = "commentary" if raw.phase == "commentary" else "final"
        self.items.append(Message(raw.role, raw.text(), channel))
        self.listed.append(_listed_message(raw))


def _reasoning_text(raw: ReasoningItem, param: str) -> str:
    """A reasoning item's text: its content's, or else the text its encrypted_content holds."""
    if raw.content or raw.encrypted_content is None:
        return raw.text()
    text = unseal(raw.encrypted_content)
    if text is None:
        raise bad_request(
            "The encrypted content of this reasoning item could not be decoded: it was not "
            "made by this server.", f"{param}.encrypted_content", "invalid_encrypted_content",
        )  # fmt: skip
    return text


def _compaction_summary(raw: CompactionItem, param: str) -> str:
    summary = unseal(raw.encrypted_content, COMPACTION_PREFIX)
    if summary is None:
        raise bad_request(
            "The encrypted content of this compaction item could not be decoded: it was not "
            "made by this server's /v1/responses/compact.", f"{param}.encrypted_content",
            "invalid_encrypted_content",
        )  # fmt: skip
    return summary


def _parse_stored_item(stored: dict[str, Any]) -> Any:
    """A stored item (output of an earlier response, or its input) as a request item."""
    data = {k: v for k, v in stored.items() if k not in ("status",)}
    if data.get("type") == "message":
        data["content"] = [_stored_part(part) for part in data.get("content", [])]
    return _INPUT_ITEM.validate_python(data)


def _stored_part(part: dict[str, Any]) -> dict[str, Any]:
    """A stored message's content part as a request's (its text; annotations and logprobs of
    output text left behind)."""
    if part["type"] == "refusal":
        return {"type": "refusal", "refusal": part["refusal"]}
    return {"type": part["type"], "text": part["text"]}


def _listed(raw: Any, prefix: str) -> dict[str, Any]:
    data = raw.model_dump(mode="json", exclude_none=True, by_alias=True)
    data["id"] = raw.id or new_id(prefix)
    data["status"] = raw.status or "completed"
    return data


def _listed_message(raw: InputMessage) -> dict[str, Any]:
    if isinstance(raw.content, str):
        kind = "output_text" if raw.role == "assistant" else "input_text"
        content = [{"type": kind, "text": raw.content}]
    else:
        content = [part.model_dump(mode="json", exclude_none=True) for part in raw.content]
    if raw.role == "assistant":
        for part in content:
            if part["type"] == "output_text":
                part.setdefault("annotations", [])
    return {
        "id": raw.id or new_id("msg"),
        "type": "message",
        "role": raw.role,
        "content": content,
        "status": raw.status or "completed",
    }


def output_to_items(output: list[dict[str, Any]]) -> list[Item]:
    """The output of a response as conversation items (to continue from it later)."""
    items: list[Item] = []
    for entry in output:
        if entry["type"] == "reasoning":
            items.append(Reasoning("".join(part["text"] for part in entry["content"])))
        elif entry["type"] == "message":
            text = "".join(part["text"] for part in entry["content"] if "text" in part)
            channel = "commentary" if entry.get("phase") == "commentary" else "final"
            items.append(Message("assistant", text, channel))
        elif entry["type"] == "function_call":
            namespace = entry.get("namespace") or FUNCTIONS
            items.append(
                FunctionCall(entry["call_id"], entry["name"], entry["arguments"], namespace)
            )
        elif entry["type"] == "compaction":
            summary = unseal(entry["encrypted_content"], COMPACTION_PREFIX)
            if summary is None:  # this server's own output: it always decodes
                raise ValueError(f"compaction item {entry['id']} does not decode")
            items.append(Compaction(summary))
    return items
