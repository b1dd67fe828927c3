"""``POST /v1/responses/compact``: a conversation compacted into its user messages and one
``compaction`` item, the summary that stands in for everything else (the official API's
standalone compaction). A client sends the output back as the next turn's input, followed by
its new items.

The model writes the summary. Its prompt is the conversation (the ``previous_response_id``
chain's items, then ``input``) under the request's ``instructions``, followed by one more user
message asking for the summary; it reasons briefly (``REASONING_BUDGET``) and answers in at
most ``SUMMARY_TOKENS``. The prompt keeps room for both: a conversation too long for that
loses its oldest items from the summary's prompt (``truncation: auto``), never from the
output's user messages. The summary travels as the item's ``encrypted_content``
(server/reasoning_seal.py) and is rendered, when it comes back, as a user message that says
what it is (harmony/render.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.client import EngineClient
from gptoss_serve.harmony.conversation import Message
from gptoss_serve.harmony.replay import GeneratedMessages
from gptoss_serve.server.errors import APIError, bad_request
from gptoss_serve.server.objects import CompactedResponseObject, new_id
from gptoss_serve.server.protocol import (
    CompactRequest,
    CreateResponseRequest,
    InputMessage,
    ReasoningConfig,
)
from gptoss_serve.server.reasoning_seal import COMPACTION_PREFIX, seal
from gptoss_serve.server.render_workers import RenderWorkers
from gptoss_serve.server.responses import Prepared, finish, fit_prompt, make_draft
from gptoss_serve.server.store import ResponseStore

logger = logging.getLogger(__name__)

SUMMARY_REQUEST = (
    "Stop here. Write a summary of this conversation that you will continue from in place of "
    "everything above it: the task and its goal, what was done and what was found, decisions "
    "and their reasons, the state of the work, and what remains to do. Keep names, paths, "
    "commands, numbers and identifiers exactly as they were. Write only the summary."
)
REASONING_BUDGET = 256  # tokens of analysis before the summary must begin
SUMMARY_TOKENS = 2048  # the summary's own room


@dataclass(frozen=True)
class Compacting:
    """A compaction under way: the summary's generation, and the conversation's user
    messages as the output lists them."""

    prepared: Prepared
    user_messages: list[dict[str, Any]]


async def prepare_compaction(
    body: CompactRequest,
    engine: EngineClient,
    store: ResponseStore,
    config: ServerConfig,
    renderers: RenderWorkers,
    *,
    replays: GeneratedMessages,
) -> Compacting:
    """Check the request and build the summary's prompt. Raises APIError (a 4xx)."""
    request = summary_request(body)
    draft = await make_draft(request, engine, store, config)
    if len(draft.render.items) == 1:  # the summary request alone
        raise bad_request("There is nothing to compact: give the conversation as input, or a "
                          "previous_response_id.", "input")  # fmt: skip
    fitted = await fit_prompt(draft, renderers, replays, reserve=REASONING_BUDGET + SUMMARY_TOKENS)
    prepared = finish(draft, config, fitted)
    users = []
    for index, item in enumerate(draft.render.items[:-1]):
        if not (isinstance(item, Message) and item.role == "user"):
            continue
        own = index - draft.history_len  # this request's items come with their listed form
        item_id = draft.input_items[own]["id"] if own >= 0 else new_id("msg")
        users.append({"id": item_id, "type": "message", "role": "user", "status": "completed",
                      "content": [{"type": "input_text", "text": item.text}]})  # fmt: skip
    return Compacting(prepared, users)


def summary_request(body: CompactRequest) -> CreateResponseRequest:
    """The response that writes the summary: the conversation and the summary request, under
    the request's instructions, stored nowhere, no tools called, brief reasoning."""
    items: list[Any] = []
    if isinstance(body.input, str):
        items.append(InputMessage(role="user", content=body.input))
    elif body.input is not None:
        items.extend(body.input)
    items.append(InputMessage(role="user", content=SUMMARY_REQUEST))
    return CreateResponseRequest.model_construct(
        model=body.model,
        input=items,
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        store=False,
        tool_choice="none",
        truncation="auto",
        reasoning=ReasoningConfig(effort="low"),
        reasoning_budget=REASONING_BUDGET,
        max_output_tokens=REASONING_BUDGET + SUMMARY_TOKENS,
        prompt_cache_key=body.prompt_cache_key,
    )


def compacted(compacting: Compacting) -> CompactedResponseObject:
    """The compacted response, once the summary's generation has ended. Raises APIError (a
    500) if the generation failed."""
    response = compacting.prepared.response
    if response.status == "failed":
        message = response.error.message if response.error else "the generation failed"
        raise APIError(500, f"The compaction failed: {message}", code="server_error",
                       error_type="server_error")  # fmt: skip
    answer = [
        part.text
        for item in response.output
        if item.type == "message" and item.phase != "commentary"
        for part in item.content
    ]
    if response.status != "completed":
        logger.warning("compaction %s: the summary was cut at %d output tokens", response.id,
                       response.usage.output_tokens)  # fmt: skip
    summary = {"id": new_id("cmp"), "type": "compaction",
               "encrypted_content": seal("".join(answer), COMPACTION_PREFIX)}  # fmt: skip
    return CompactedResponseObject(
        id=response.id,
        created_at=int(time.time()),
        output=[*compacting.user_messages, summary],
        usage=response.usage,
    )
