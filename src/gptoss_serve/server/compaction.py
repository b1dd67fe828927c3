"""Compaction: a conversation summarised by the model, the summary standing in for the items
it replaced (the official API's two ways).

- ``POST /v1/responses/compact`` (``prepare_compaction``, ``compacted``): the answer is the
  conversation's user messages and one ``compaction`` item. A client sends it back as the next
  turn's input, followed by its new items.
- ``context_management: [{"type": "compaction", "compact_threshold": N}]`` on a create request
  (``compacting_preparer``): if the conversation's prompt is over N tokens (or over the
  context), the summary is made first; the response's first output item is the compaction,
  and its prompt is the user messages and the summary. A ``compaction_trigger`` as the last
  input item does the same whatever the prompt's size.

The model writes the summary. Its prompt is the conversation (the ``previous_response_id``
chain's or the conversation's items, then ``input``) under the request's ``instructions``,
followed by one more user message asking for the summary; no tools are declared, it reasons
briefly (``REASONING_BUDGET``) and answers in at most ``SUMMARY_TOKENS``. The prompt keeps room
for both: a conversation too long for that loses its oldest items from the summary's prompt
(``truncation: auto``), never from the listed user messages. The summary travels as the item's
``encrypted_content`` (server/reasoning_seal.py); in a prompt it is a user message that says
what it is, and every item before it but the user and system/developer messages is left out
(harmony/render.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.client import EngineClient
from gptoss_serve.harmony.conversation import Compaction, Item, Message
from gptoss_serve.harmony.render import compacted_away, kept_by_compaction
from gptoss_serve.harmony.replay import GeneratedMessages
from gptoss_serve.server.errors import APIError
from gptoss_serve.server.metrics import ServerMetrics
from gptoss_serve.server.objects import CompactedResponseObject, CompactionOutput, new_id
from gptoss_serve.server.protocol import (
    CompactionTrigger,
    CompactRequest,
    CreateResponseRequest,
    InputMessage,
    ReasoningConfig,
)
from gptoss_serve.server.reasoning_seal import COMPACTION_PREFIX, seal
from gptoss_serve.server.render_workers import RenderWorkers
from gptoss_serve.server.responses import Draft, Prepared, finish, fit_prompt, make_draft, run
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
# context_management without compact_threshold: compact past this share of the context.
DEFAULT_THRESHOLD_SHARE = 0.8


@dataclass(frozen=True)
class Services:
    """What a summary's generation runs on (the app's)."""

    engine: EngineClient
    store: ResponseStore
    config: ServerConfig
    renderers: RenderWorkers
    replays: GeneratedMessages
    metrics: ServerMetrics | None = None


# -- POST /v1/responses/compact ---------------------------------------------------------------


@dataclass(frozen=True)
class Compacting:
    """A compaction under way: the summary's generation, and the conversation's user
    messages as the output lists them."""

    prepared: Prepared
    user_messages: list[dict[str, Any]]


async def prepare_compaction(body: CompactRequest, services: Services) -> Compacting:
    """Check the request and build the summary's prompt. Raises APIError (a 4xx)."""
    request = CreateResponseRequest.model_construct(
        model=body.model,
        input=[InputMessage(role="user", content=body.input)]
        if isinstance(body.input, str)
        else list(body.input or ()),
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        prompt_cache_key=body.prompt_cache_key,
    )
    draft = await make_draft(request, services.engine, services.store, services.config)
    users = []
    for index, item in enumerate(draft.render.items):
        if not (isinstance(item, Message) and item.role == "user"):
            continue
        own = index - draft.history_len  # this request's items come with their listed form
        item_id = draft.input_items[own]["id"] if own >= 0 else new_id("msg")
        users.append({"id": item_id, "type": "message", "role": "user", "status": "completed",
                      "content": [{"type": "input_text", "text": item.text}]})  # fmt: skip
    return Compacting(await _prepare_summary(draft, services), users)


def compacted(compacting: Compacting, metrics: ServerMetrics | None) -> CompactedResponseObject:
    """The compacted response, once the summary's generation has ended (counted in
    ``metrics``). Raises APIError (a 500) if the generation failed."""
    sealed = _sealed(compacting.prepared, metrics, "compact")
    summary = CompactionOutput(id=new_id("cmp"), encrypted_content=sealed)
    return CompactedResponseObject(
        id=compacting.prepared.response.id,
        created_at=int(time.time()),
        output=[*compacting.user_messages, summary.model_dump(mode="json")],
        usage=compacting.prepared.response.usage,
    )


# -- context_management -----------------------------------------------------------------------


def compacting_preparer(
    request: CreateResponseRequest, services: Services
) -> Callable[[Draft], Awaitable[Prepared]] | None:
    """``responses.prepare``'s ``compactor`` for a request with ``context_management`` or
    whose input ends with a ``compaction_trigger`` (that one compacts whatever the prompt's
    size); None for any other."""
    triggered = bool(request.input) and isinstance(request.input[-1], CompactionTrigger)
    if not request.context_management and not triggered:
        return None
    threshold = 0 if triggered else request.context_management[0].compact_threshold
    return functools.partial(_prepare_compacted, services=services, threshold=threshold)


async def _prepare_compacted(
    draft: Draft, *, services: Services, threshold: int | None
) -> Prepared:
    """The response prepared as ``responses.prepare`` does, after its conversation was
    summarised if its whole prompt is over ``threshold`` tokens (None: a share of the
    context) or over the context, and the summary can leave something out."""
    whole = dataclasses.replace(
        draft, request=draft.request.model_copy(update={"truncation": "disabled"})
    )
    fitted = None
    try:
        fitted = await fit_prompt(whole, services.renderers, services.replays)
    except APIError as error:
        if error.code != "context_length_exceeded":
            raise
    limit = int(DEFAULT_THRESHOLD_SHARE * draft.context) if threshold is None else threshold
    if fitted is not None and len(fitted[0]) <= limit:
        return finish(draft, services.config, fitted)
    if not _summary_leaves_out(draft.render.items):  # a summary would not shorten it
        return finish(draft, services.config, await fit_prompt(draft, services.renderers,
                                                               services.replays))  # fmt: skip
    summarising = await _prepare_summary(draft, services)
    await _run_to_end(summarising, services)
    sealed = _sealed(summarising, services.metrics, "managed")
    summary = Compaction(_answer(summarising))
    with_summary = dataclasses.replace(
        draft, render=dataclasses.replace(draft.render, items=(*draft.render.items, summary))
    )
    prompt_ids, render = await fit_prompt(with_summary, services.renderers, services.replays)
    # The conversation is the request's (the summary is the output's first item).
    conversation = dataclasses.replace(render, items=render.items[:-1])
    prepared = finish(draft, services.config, (prompt_ids, conversation))
    prepared.compaction = CompactionOutput(id=new_id("cmp"), encrypted_content=sealed)
    logger.info("response %s: compacted a prompt of %s tokens to %d", prepared.response.id,
                "over the context's" if fitted is None else len(fitted[0]),
                len(prompt_ids))  # fmt: skip
    return prepared


def _summary_leaves_out(items: tuple[Item, ...]) -> bool:
    """Whether the prompt has an item a summary would replace (a compaction keeps the user
    messages, and the system/developer ones are the instructions): an assistant message, a
    call, its output or reasoning not out of the prompt already."""
    hidden = compacted_away(items)
    return any(
        not (kept_by_compaction(item) or isinstance(item, Compaction))
        for index, item in enumerate(items)
        if index not in hidden
    )


# -- the summary ------------------------------------------------------------------------------


async def _prepare_summary(draft: Draft, services: Services) -> Prepared:
    """The response that writes the summary of ``draft``'s conversation: it and the summary
    request, under the same instructions, no tools, brief reasoning, stored nowhere, with room
    for the summary (the oldest items out of its prompt where that room needs it)."""
    request = CreateResponseRequest.model_construct(
        model=draft.request.model,
        input=[],
        instructions=draft.request.instructions,
        store=False,
        tool_choice="none",
        truncation="auto",
        reasoning=ReasoningConfig(effort="low"),
        reasoning_budget=REASONING_BUDGET,
        max_output_tokens=REASONING_BUDGET + SUMMARY_TOKENS,
        prompt_cache_key=draft.request.prompt_cache_key,
    )
    items = (*draft.render.items, Message("user", SUMMARY_REQUEST))
    render = dataclasses.replace(draft.render, items=items, tools=(), namespaces=(),
                                 response_format=None, reasoning_effort="low")  # fmt: skip
    summary = Draft(request, render, [], draft.model_name, draft.context, len(items))
    fitted = await fit_prompt(summary, services.renderers, services.replays,
                              reserve=REASONING_BUDGET + SUMMARY_TOKENS)  # fmt: skip
    return finish(summary, services.config, fitted)


async def _run_to_end(prepared: Prepared, services: Services) -> None:
    async for _ in run(prepared, services.engine, services.store, services.metrics):
        pass


def _answer(prepared: Prepared) -> str:
    """The summary: the text of the generation's answer."""
    return "".join(
        part.text
        for item in prepared.response.output
        if item.type == "message" and item.phase != "commentary"
        for part in item.content
    )


def _sealed(prepared: Prepared, metrics: ServerMetrics | None, way: str) -> str:
    """The ended generation's summary, sealed (a compaction counted in ``metrics`` by its
    ``way``); a failed one raises APIError (a 500)."""
    response = prepared.response
    if response.status == "failed":
        message = response.error.message if response.error else "the generation failed"
        raise APIError(500, f"The compaction failed: {message}", code="server_error",
                       error_type="server_error")  # fmt: skip
    if response.status != "completed":
        logger.warning("compaction %s: the summary was cut at %d output tokens", response.id,
                       response.usage.output_tokens)  # fmt: skip
    if metrics is not None:
        metrics.compactions.labels(way=way).inc()
    return seal(_answer(prepared), COMPACTION_PREFIX)
