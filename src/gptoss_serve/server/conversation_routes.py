"""``/v1/conversations``: create, read, update and delete conversations and their items, as the
official Conversations API (``client.conversations`` in the SDK). A response created with
``conversation`` reads its items and adds its own (responses.py); the items are kept by
conversation_store.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query

from gptoss_serve.server.conversation import item_from_json
from gptoss_serve.server.conversation_locks import ConversationLocks
from gptoss_serve.server.conversation_store import ConversationItem
from gptoss_serve.server.errors import APIError, bad_request, not_found
from gptoss_serve.server.objects import (
    ConversationItemList,
    ConversationObject,
    DeletedConversation,
    ErrorResponse,
    new_id,
)
from gptoss_serve.server.protocol import (
    AddConversationItemsRequest,
    CreateConversationRequest,
    InputItem,
    UpdateConversationRequest,
)
from gptoss_serve.server.reasoning_seal import seal
from gptoss_serve.server.responses import (
    OUTPUT_TEXT_LOGPROBS,
    REASONING_ENCRYPTED_CONTENT,
    check_includes,
    check_new_items,
    conversation_items,
    input_converter,
)
from gptoss_serve.server.store import ResponseStore

logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404)}
Include = Annotated[list[str] | None, Query()]


def add_conversation_routes(app: FastAPI, store: ResponseStore, locks: ConversationLocks) -> None:
    conversations = store.conversations

    @app.post("/v1/conversations", response_model=ConversationObject, responses=_ERRORS)
    async def create_conversation(body: CreateConversationRequest) -> dict[str, Any]:
        items = await asyncio.to_thread(_convert, store, None, body.items or [], "items")
        conversation_id = new_id("conv")
        return conversations.create(conversation_id, body.metadata or {}, items)

    @app.get("/v1/conversations/{conversation_id}", response_model=ConversationObject,
             responses=_ERRORS)  # fmt: skip
    async def get_conversation(conversation_id: str) -> dict[str, Any]:
        return _conversation_or_404(store, conversation_id)

    @app.post("/v1/conversations/{conversation_id}", response_model=ConversationObject,
              responses=_ERRORS)  # fmt: skip
    async def update_conversation(
        conversation_id: str, body: UpdateConversationRequest
    ) -> dict[str, Any]:
        updated = conversations.update(conversation_id, body.metadata or {})
        if updated is None:
            raise _conversation_not_found(conversation_id)
        return updated

    @app.delete("/v1/conversations/{conversation_id}", response_model=DeletedConversation,
                responses=_ERRORS)  # fmt: skip
    async def delete_conversation(conversation_id: str) -> DeletedConversation:
        if not conversations.delete(conversation_id):
            raise _conversation_not_found(conversation_id)
        return DeletedConversation(id=conversation_id)

    @app.post("/v1/conversations/{conversation_id}/items", response_model=ConversationItemList,
              responses=_ERRORS)  # fmt: skip
    async def add_items(
        conversation_id: str, body: AddConversationItemsRequest, include: Include = None
    ) -> ConversationItemList:
        includes = check_includes(include)
        lease = locks.acquire(conversation_id)  # no response may start on it meanwhile
        try:
            items = await asyncio.to_thread(_convert, store, conversation_id, body.items, "items")
            if not conversations.append(conversation_id, items):
                raise _conversation_not_found(conversation_id)
        finally:
            lease.release()
        return ConversationItemList.page([_shown(i.listed, includes) for i in items], False)

    @app.get("/v1/conversations/{conversation_id}/items", response_model=ConversationItemList,
             responses=_ERRORS)  # fmt: skip
    async def list_items(
        conversation_id: str,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        include: Include = None,
    ) -> ConversationItemList:
        includes = check_includes(include)
        try:
            found = conversations.list_items(conversation_id, after, limit, order)
        except KeyError:
            raise not_found(f"Item with id '{after}' not found.", "after") from None
        if found is None:
            raise _conversation_not_found(conversation_id)
        page, has_more = found
        return ConversationItemList.page([_shown(item, includes) for item in page], has_more)

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}", responses=_ERRORS)
    async def get_item(
        conversation_id: str, item_id: str, include: Include = None
    ) -> dict[str, Any]:
        includes = check_includes(include)
        _conversation_or_404(store, conversation_id)
        item = conversations.item(conversation_id, item_id)
        if item is None:
            raise not_found(f"Item with id '{item_id}' not found.", "item_id")
        return _shown(item, includes)

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}",
                response_model=ConversationObject, responses=_ERRORS)  # fmt: skip
    async def delete_item(conversation_id: str, item_id: str) -> dict[str, Any]:
        conversation = _conversation_or_404(store, conversation_id)
        locks.check(conversation_id)
        if not conversations.delete_item(conversation_id, item_id):
            raise not_found(f"Item with id '{item_id}' not found.", "item_id")
        return conversation


def _convert(
    store: ResponseStore, conversation_id: str | None, raw_items: list[InputItem], param: str
) -> list[ConversationItem]:
    """Request items as conversation items, checked as a response's input is (a tool output
    needs its call in the conversation or before it; references must resolve; ids must not
    repeat). Raises APIError."""
    history = []
    if conversation_id is not None:
        stored = store.conversations.history(conversation_id)
        if stored is None:
            raise _conversation_not_found(conversation_id)
        history = [item_from_json(entry) for entry in stored.items]
    converter = input_converter(store, history)
    for index, raw in enumerate(raw_items):
        converter.add(raw, f"{param}[{index}]")
    if converter.trigger_param is not None:
        raise bad_request("A compaction trigger is an input item of a response, not an item "
                          "of a conversation.", f"{converter.trigger_param}.type")  # fmt: skip
    check_new_items(store, conversation_id, converter.listed, param)
    return conversation_items(converter.listed, converter.items)


def _shown(item: dict[str, Any], includes: frozenset[str]) -> dict[str, Any]:
    """A stored item as listed: output text's log-probabilities only when asked for (and only
    what its response made), a reasoning item's encrypted_content only when asked for."""
    if item.get("type") == "reasoning":
        if REASONING_ENCRYPTED_CONTENT not in includes:
            return {**item, "encrypted_content": None}
        if item.get("content"):  # else: as the client sent it (its encrypted_content alone)
            return {**item, "encrypted_content": seal("".join(p["text"] for p in item["content"]))}
        return item
    if item.get("type") == "message" and OUTPUT_TEXT_LOGPROBS not in includes:
        content = [
            {**part, "logprobs": []} if part.get("type") == "output_text" else part
            for part in item["content"]
        ]
        return {**item, "content": content}
    return item


def _conversation_or_404(store: ResponseStore, conversation_id: str) -> dict[str, Any]:
    conversation = store.conversations.get(conversation_id)
    if conversation is None:
        raise _conversation_not_found(conversation_id)
    return conversation


def _conversation_not_found(conversation_id: str) -> APIError:
    return not_found(f"Conversation with id '{conversation_id}' not found.", "conversation_id")
