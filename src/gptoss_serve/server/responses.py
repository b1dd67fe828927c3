"""One response's orchestration: validate, render, generate, parse, emit events, store.

``prepare`` turns a request into everything generation needs or raises a 4xx APIError;
``run`` drives the engine and yields streaming events, leaving the final object in its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gptoss_serve.config import SampledToken, SamplingParams, ServerConfig
from gptoss_serve.engine.client import EngineClient, EngineError
from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import (
    Item,
    RenderRequest,
    ResponseFormat,
)
from gptoss_serve.harmony.parse import HarmonyStreamParser
from gptoss_serve.harmony.replay import GeneratedMessages
from gptoss_serve.server import context_fit, events
from gptoss_serve.server.constraints import constraint_grammar, reasoning_budget
from gptoss_serve.server.conversation import (
    InputConverter,
    item_from_json,
    item_to_json,
    output_to_items,
)
from gptoss_serve.server.conversation_locks import ConversationLease, ConversationLocks
from gptoss_serve.server.conversation_store import ConversationItem
from gptoss_serve.server.errors import APIError, bad_request, not_found
from gptoss_serve.server.generated_tokens import GeneratedTokens
from gptoss_serve.server.logprobs import logprob_entry
from gptoss_serve.server.metrics import RequestTimer, ServerMetrics
from gptoss_serve.server.objects import (
    CompactionOutput,
    ConversationRefObject,
    IncompleteDetails,
    ResponseError,
    ResponseObject,
    Usage,
    new_id,
)
from gptoss_serve.server.protocol import (
    CreateResponseRequest,
    TextFormatJsonSchema,
)
from gptoss_serve.server.render_workers import RenderWorkers
from gptoss_serve.server.request_ids import current_request_id, request_received_at
from gptoss_serve.server.store import ResponseStore
from gptoss_serve.server.tools import checked_tools

logger = logging.getLogger(__name__)

# The answer's log-probabilities (output_text parts and their deltas), and the reasoning items'
# encrypted_content (server/reasoning_seal.py: what a stateless client sends back).
OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"
REASONING_ENCRYPTED_CONTENT = "reasoning.encrypted_content"
SUPPORTED_INCLUDES = frozenset({OUTPUT_TEXT_LOGPROBS, REASONING_ENCRYPTED_CONTENT})


@dataclass
class Prepared:
    request: CreateResponseRequest
    response: ResponseObject
    prompt_ids: list[int]
    conversation: list[Item]  # previous + this request's input (what a follow-up continues)
    input_items: list[dict[str, Any]]
    params: SamplingParams
    # How ``conversation`` continues the previous response's, so that the store can keep only
    # a delta: (its id, how many of its leading items the fitting dropped, where this
    # request's own items start); None when nothing of it is left (or there is none).
    parent: tuple[str, int, int] | None = None
    # With ``conversation``: this request's own items (as ``input_items``, in Harmony form),
    # added to it with the output when the response ends, and the lease that keeps other
    # responses off it meanwhile (conversation_locks.py).
    own_items: list[Item] = field(default_factory=list)
    lease: ConversationLease | None = None
    num_dropped: int = 0  # the history's leading items the fitting dropped
    # Asked after each token's events are consumed: True ends the generation there, as
    # completed (the chat API's stop sequences, which its layer matches in the text).
    stop_when: Callable[[], bool] | None = None
    # Where the messages this response completes are kept for the prompts that replay them
    # (harmony/replay.py); None: not kept.
    replays: GeneratedMessages | None = None
    # When the request arrived (time.monotonic()): ``run`` reports the time until it started.
    received_at: float = field(default_factory=time.monotonic)
    # The summary this response made of its conversation first (``context_management``,
    # compaction.py): its first output item, and the prompt continues from it.
    compaction: CompactionOutput | None = None
    state: events.StreamState = field(init=False)

    def __post_init__(self) -> None:
        sealed = REASONING_ENCRYPTED_CONTENT in (self.request.include or ())
        self.state = events.StreamState(self.response, seal_reasoning=sealed)


@dataclass(frozen=True)
class Draft:
    """A request checked and its conversation built: ``prepare`` before any token."""

    request: CreateResponseRequest
    render: RenderRequest
    input_items: list[dict[str, Any]]
    model_name: str
    context: int
    history_len: int = 0  # the leading items of render.items that the history gave
    # The stored response whose conversation the history is, after how many leading items
    # (previous_response_id: all of it; a conversation: its last stored turn's, if any).
    continues: tuple[str, int] | None = None


async def prepare(
    request: CreateResponseRequest,
    engine: EngineClient,
    store: ResponseStore,
    config: ServerConfig,
    renderers: RenderWorkers,
    *,
    locks: ConversationLocks,
    replays: GeneratedMessages,
    compactor: Callable[[Draft], Awaitable[Prepared]] | None = None,
) -> Prepared:
    """Check everything a client could get wrong; build the prompt. Raises APIError. A large
    input's tokens are counted in a worker thread, in short runs between which the event loop
    gets the GIL (context_fit.py); a prompt of over 32k characters is rendered in a worker
    process, since the renderer holds the GIL throughout (render_workers.py). A conversation
    is leased before its items are read (so no other response adds to it meanwhile) until the
    response ends: ``run`` releases it. The assistant messages the model generated, in
    ``replays``, go into the prompt as it generated them (harmony/replay.py); the messages this
    response completes are kept there when it ends. ``compactor`` (``context_management``,
    compaction.py) turns the draft into the prepared response, compacting it first if it must."""
    received_at = request_received_at.get() or time.monotonic()
    conversation_id = request.conversation_id
    lease = None if conversation_id is None else locks.acquire(conversation_id)
    try:
        draft = await make_draft(request, engine, store, config)
        if compactor is not None:
            prepared = await compactor(draft)
        else:
            prepared = finish(draft, config, await fit_prompt(draft, renderers, replays))
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    prepared.lease = lease
    prepared.replays = replays
    prepared.received_at = received_at
    return prepared


async def count_input_tokens(
    request: CreateResponseRequest,
    engine: EngineClient,
    store: ResponseStore,
    config: ServerConfig,
    renderers: RenderWorkers,
    *,
    replays: GeneratedMessages,
) -> int:
    """The tokens of the prompt ``request`` makes (after ``truncation: auto`` dropped what it
    must): ``POST /v1/responses/input_tokens``. Raises APIError as ``prepare`` does."""
    draft = await make_draft(request, engine, store, config)
    prompt_ids, _ = await fit_prompt(draft, renderers, replays)
    return len(prompt_ids)


async def make_draft(
    request: CreateResponseRequest, engine: EngineClient, store: ResponseStore, config: ServerConfig
) -> Draft:
    """``begin`` in a worker thread when it reads a stored conversation: a long one is a
    query and many small JSON parses, between which the event loop gets the GIL (in-line, the
    streams would wait for all of it)."""
    if request.previous_response_id is None and request.conversation is None:
        return begin(request, engine, store, config)
    return await asyncio.to_thread(begin, request, engine, store, config)


async def fit_prompt(
    draft: Draft, renderers: RenderWorkers, replays: GeneratedMessages, *, reserve: int = 0
) -> tuple[list[int], RenderRequest]:
    """The draft's prompt fitted to the context (``context_fit``), with the generated
    messages ``replays`` knows replayed (unless that would leave no room for an output
    token: the generated tokens of a message may be more than its render's). ``reserve``:
    tokens of the context kept free besides that one (the prompt fits in the rest)."""
    render, truncation = draft.render, draft.request.truncation
    context = max(draft.context - reserve, 1)
    if context_fit.large_input(render.items):
        bounds = await asyncio.to_thread(context_fit.token_bounds, render.items, context)
    else:
        bounds = context_fit.token_bounds(render.items, context)
    prompt_ids, render = await renderers.fit_context(render, truncation, context, bounds)
    replayed = replays.replay(prompt_ids)
    return (replayed if len(replayed) < context else prompt_ids), render


def begin(
    request: CreateResponseRequest, engine: EngineClient, store: ResponseStore, config: ServerConfig
) -> Draft:
    """The checks and the conversation (no tokenization). Raises APIError."""
    info = engine.info
    served = config.served_model_ids(info.model_name)
    if request.model not in served:
        names = ", ".join(f"'{name}'" for name in served)
        raise APIError(
            404, f"The model '{request.model}' does not exist; this server serves {names}.",
            param="model", code="model_not_found",
        )  # fmt: skip
    _check_values(request.model_dump(by_alias=True, exclude_unset=True))
    _check_unsupported(request)
    tools, namespaces = checked_tools(request)
    history, continues = _history(request, store)
    converter = input_converter(store, history)
    if isinstance(request.input, str):
        converter.add_text(request.input)
    else:
        for index, raw in enumerate(request.input):
            converter.add(raw, f"input[{index}]")
        if converter.trigger_param not in (None, f"input[{len(request.input) - 1}]"):
            raise bad_request("A compaction trigger must be the final input item.",
                              converter.trigger_param)  # fmt: skip
    if request.conversation_id is not None:
        check_new_items(store, request.conversation_id, converter.listed, "input")
    conversation = history + converter.items
    if not conversation:
        raise bad_request("The input must contain at least one item.", "input")
    render = RenderRequest(
        items=tuple(conversation),
        instructions=request.instructions,
        reasoning_effort=request.reasoning.effort or config.reasoning_effort,
        tools=tools,
        namespaces=namespaces,
        response_format=_response_format(request),
    )
    return Draft(
        request, render, converter.listed, info.model_name, info.max_context_tokens,
        len(history), continues,
    )  # fmt: skip


def finish(draft: Draft, config: ServerConfig, fitted: tuple[list[int], RenderRequest]) -> Prepared:
    """From the prompt fitted to the context (``context_fit.fit_context`` of the draft's
    render): the sampling parameters and the in-progress response object. Raises APIError."""
    request, context = draft.request, draft.context
    prompt_ids, render = fitted
    room = context - len(prompt_ids)
    max_tokens = min(request.max_output_tokens or config.default_max_output_tokens or room, room)
    budget = reasoning_budget(request, render.reasoning_effort, max_tokens, config)
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if top_p == 0 else temperature,  # top_p 0 keeps only the top token
        top_p=top_p or 1.0,
        stop_token_ids=adapter.assistant_stop_token_ids(),
        grammar=constraint_grammar(request, budget),
        logprobs=wanted_logprobs(request),
    )
    response = ResponseObject(
        id=new_id("resp"),
        created_at=int(time.time()),
        status="in_progress",
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        max_tool_calls=request.max_tool_calls,
        metadata=request.metadata or {},
        model=draft.model_name,
        parallel_tool_calls=request.parallel_tool_calls,
        previous_response_id=request.previous_response_id,
        conversation=_conversation_ref(request),
        prompt_cache_key=request.prompt_cache_key,
        prompt_cache_retention=request.prompt_cache_retention,
        reasoning=request.reasoning.model_copy(update={"effort": render.reasoning_effort}),
        safety_identifier=request.safety_identifier,
        service_tier=request.service_tier or "default",
        store=request.store,
        temperature=temperature,
        text=request.text,
        tool_choice=request.tool_choice,
        tools=request.tools,
        top_logprobs=request.top_logprobs or 0,
        top_p=top_p,
        truncation=request.truncation,
        user=request.user,
    )
    prepared = Prepared(
        request, response, prompt_ids, list(render.items), draft.input_items, params,
        own_items=list(draft.render.items[draft.history_len :]),
    )  # fmt: skip
    # The fitting drops whole items from the front (truncation: auto): of the history first.
    dropped = len(draft.render.items) - len(render.items)
    prepared.num_dropped = dropped
    if draft.continues is not None:
        parent_id, offset = draft.continues
        if offset <= dropped < draft.history_len:
            prepared.parent = (parent_id, dropped - offset, draft.history_len - dropped)
    return prepared


def wanted_logprobs(request: CreateResponseRequest) -> int | None:
    """The alternatives a token's log-probabilities come with, when the request includes the
    answer's log-probabilities (``top_logprobs`` alone returns none: the include is what asks
    for them); None: no log-probabilities."""
    if OUTPUT_TEXT_LOGPROBS not in (request.include or ()):
        return None
    return request.top_logprobs or 0


def _check_unsupported(request: CreateResponseRequest) -> None:
    if request.background and not request.store:
        raise bad_request("Background responses must be stored: background requires store=true.",
                          "background")  # fmt: skip
    check_includes(request.include)


def check_includes(values: list[str] | None) -> frozenset[str]:
    """The ``include`` values (of a response, or of a conversation items call), each one this
    server supports; else a 400 naming it."""
    for index, value in enumerate(values or ()):
        if value not in SUPPORTED_INCLUDES:
            raise bad_request(f"include value '{value}' is not supported by this server.",
                              f"include[{index}]", "unsupported_parameter")  # fmt: skip
    return frozenset(values or ())


# JSON's \ud800-\udfff escapes decode to lone UTF-16 surrogates, which are not Unicode text:
# the Harmony renderer (Rust) and the store cannot take them.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_values(value: Any, path: str = "") -> None:
    """Refuse a request whose JSON (at any depth) holds a string with a lone surrogate, or a
    NaN or infinite number: the body parser takes ``NaN`` and ``Infinity``, but they are not
    JSON, and a schema holding one cannot be rendered into the prompt."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise bad_request(f"Invalid value for '{path}': the string holds a lone UTF-16 "
                              "surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                              "valid Unicode.", path or None)  # fmt: skip
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise bad_request(f"Invalid value for '{path}': {value} is not a valid JSON number "
                              "(NaN and Infinity are not JSON).", path or None)  # fmt: skip
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_values(key, path)
            _check_values(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_values(item, f"{path}[{index}]")


def _history(
    request: CreateResponseRequest, store: ResponseStore
) -> tuple[list[Item], tuple[str, int] | None]:
    """The items before the request's input, and the stored response whose conversation they
    are (after how many leading items), if there is one (``Draft.continues``)."""
    conversation_id = request.conversation_id
    if conversation_id is not None:
        if request.previous_response_id is not None:
            message = "Mutually exclusive parameters: provide only one of 'previous_response_id' "
            raise bad_request(message + "or 'conversation'.", "conversation")
        found = store.conversations.history(conversation_id)
        if found is None:
            raise not_found(f"Conversation with id '{conversation_id}' not found.", "conversation")
        return [item_from_json(entry) for entry in found.items], found.last
    if request.previous_response_id is None:
        return [], None
    stored = store.conversation(request.previous_response_id)
    if stored is None:
        raise APIError(
            404, f"Previous response with id '{request.previous_response_id}' not found.",
            param="previous_response_id", code="previous_response_not_found",
        )  # fmt: skip
    return [item_from_json(entry) for entry in stored], (request.previous_response_id, 0)


def _conversation_ref(request: CreateResponseRequest) -> ConversationRefObject | None:
    conversation_id = request.conversation_id
    return None if conversation_id is None else ConversationRefObject(id=conversation_id)


def input_converter(store: ResponseStore, history: list[Item]) -> InputConverter:
    """A converter of input items after ``history``, whose ``item_reference``s name a stored
    response's input or output item, or else an item of a conversation."""

    def stored_item(item_id: str) -> dict[str, Any] | None:
        found = store.item(item_id)
        return found if found is not None else store.conversations.find_item(item_id)

    return InputConverter(history, stored_item)


def check_new_items(
    store: ResponseStore, conversation_id: str | None, listed: list[dict[str, Any]], param: str
) -> None:
    """Items about to join a conversation (None: a new one) must not repeat an id, one it holds
    or one another of them has: a client sending back items the conversation holds would
    duplicate them. ``param[index]`` names the first repeat."""
    ids = [item["id"] for item in listed]
    seen = set()
    if conversation_id is not None:
        seen.update(store.conversations.present_ids(conversation_id, ids))
    for index, item_id in enumerate(ids):
        if item_id in seen:
            raise bad_request(f"Duplicate item found with id {item_id}. Remove duplicate items "
                              "from your input and try again.", f"{param}[{index}]")  # fmt: skip
        seen.add(item_id)


def _response_format(request: CreateResponseRequest) -> ResponseFormat | None:
    fmt = request.text.format
    if isinstance(fmt, TextFormatJsonSchema):
        return ResponseFormat(fmt.name, fmt.schema_, fmt.description, bool(fmt.strict))
    return None


async def run(
    prepared: Prepared,
    engine: EngineClient,
    store: ResponseStore,
    metrics: ServerMetrics | None = None,
) -> AsyncIterator[dict]:
    """Generate and yield the events; the final object is ``prepared.response``. ``metrics``
    (the app's) gets the generation's tokens and latencies; one that does not reach its end
    (a client that left, a cancel) counts as ``cancelled``."""
    timer = RequestTimer(metrics, received_at=prepared.received_at)
    try:
        async for event in _run(prepared, engine, store, timer):
            yield event
    finally:
        if not timer.ended:
            timer.end("cancelled", len(prepared.prompt_ids), 0)
        if prepared.lease is not None:
            prepared.lease.release()


async def _run(
    prepared: Prepared, engine: EngineClient, store: ResponseStore, timer: RequestTimer
) -> AsyncIterator[dict]:
    state = prepared.state
    for event in events.start(state):
        yield event
    if prepared.compaction is not None:
        for event in events.compaction(state, prepared.compaction):
            yield event
    parser = HarmonyStreamParser()
    generated = GeneratedTokens()
    num_output = num_reasoning = 0
    last_token = None
    stopped = False
    generation = engine.generate(prepared.response.id, prepared.prompt_ids, prepared.params)
    try:
        # aclosing: a stop (stop_when) ends the engine's generator, so its request, at once
        async with contextlib.aclosing(generation) as tokens:
            async for token in tokens:
                num_output += 1
                timer.token()
                last_token = token
                # A token is reasoning if it belongs to an analysis message: its header, its
                # text or the <|end|> that closes it (after which the channel reads None).
                was_analysis = parser.current_channel == "analysis"
                began = parser.awaits_start
                open_item = None if state.current is None else state.current.output_index
                parsed = parser.feed(token)
                generated.add(token, began, open_item, parsed)
                if was_analysis or parser.current_channel == "analysis":
                    num_reasoning += 1
                if (isinstance(token, SampledToken) and parser.fed_content
                        and events.takes_logprobs(state)):  # fmt: skip
                    events.add_logprobs(state, logprob_entry(token))
                for item in parsed:
                    for event in events.on_parse_event(state, item):
                        yield event
                if prepared.stop_when is not None and prepared.stop_when():
                    stopped = True
                    break
        # A message still open here was cut off: events.finish closes it as incomplete.
        _conclude(prepared, last_token, stopped)
    except EngineError as error:
        logger.error("response %s failed (%s): %s", prepared.response.id,
                     current_request_id.get(), error)  # fmt: skip
        prepared.response.status = "failed"
        prepared.response.error = ResponseError(code="server_error", message=str(error))
    if parser.framing_error:
        logger.warning("response %s: model broke Harmony framing: %s",
                       prepared.response.id, parser.framing_error)  # fmt: skip
    finished = engine.finished(prepared.response.id)
    cached = finished.cached_tokens
    prepared.response.usage = Usage(
        input_tokens=len(prepared.prompt_ids),
        input_tokens_details={"cached_tokens": cached},
        output_tokens=num_output,
        output_tokens_details={"reasoning_tokens": num_reasoning},
        total_tokens=len(prepared.prompt_ids) + num_output,
    )
    final_events = events.finish(state)
    # Off the event loop: a long conversation is megabytes of JSON, and SQLite's commit waits
    # for the disk; every other stream would stall meanwhile. Awaited before the terminal
    # event, so a client that has it finds the response stored.
    await asyncio.to_thread(_keep, prepared, store, generated)
    timer.end(prepared.response.status, len(prepared.prompt_ids), cached, finished)
    for event in final_events:
        yield event


def _keep(prepared: Prepared, store: ResponseStore, generated: GeneratedTokens) -> None:
    """The response's generated messages kept for the prompts that replay them, then the
    response stored (``store_response``)."""
    # After a compaction the next prompt's history is another (render.compacted_away).
    if prepared.replays is not None and prepared.compaction is None:
        generated.remember(prepared.replays, prepared.prompt_ids, prepared.response.output)
    store_response(prepared, store)


def _conclude(prepared: Prepared, last_token: int | None, stopped: bool = False) -> None:
    if stopped or (last_token is not None and last_token in prepared.params.stop_token_ids):
        prepared.response.status = "completed"
        prepared.response.completed_at = int(time.time())
    else:  # ran out of tokens (max_output_tokens or the context)
        prepared.response.status = "incomplete"
        prepared.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")


def conversation_items(listed: list[dict[str, Any]], items: list[Item]) -> list[ConversationItem]:
    """Items as a conversation keeps them: each as listed and as its Harmony item (one Harmony
    item per listed one, in order, as ``InputConverter`` and ``output_to_items`` make them)."""
    return [ConversationItem(a, item_to_json(b)) for a, b in zip(listed, items, strict=True)]


def store_response(prepared: Prepared, store: ResponseStore) -> None:
    """The response, its input items and its conversation, if the request asked to store; its
    input and output items added to its ``conversation``, if it has one and did not fail."""
    response = prepared.response.dump()
    output = output_to_items(response["output"])
    if prepared.lease is not None and response["status"] in ("completed", "incomplete"):
        _add_to_conversation(prepared, store, response["output"], output)
    if not prepared.response.store:
        return
    conversation = [item_to_json(item) for item in [*prepared.conversation, *output]]
    store.put(response, prepared.input_items, conversation, prepared.parent)


def _add_to_conversation(
    prepared: Prepared, store: ResponseStore, listed_output: list[dict[str, Any]],
    output: list[Item],
) -> None:  # fmt: skip
    """The request's own items and the output, after the conversation's items."""
    items = conversation_items(
        [*prepared.input_items, *listed_output], [*prepared.own_items, *output]
    )
    conversation_id = prepared.lease.conversation_id
    # Stored, this response's conversation is the conversation's items after the dropped ones:
    # the next turn's is stored as a delta on it.
    turn = (prepared.response.id, prepared.num_dropped) if prepared.response.store else None
    if not store.conversations.append(conversation_id, items, turn):
        logger.info("response %s: conversation %s was deleted while it ran; its items were "
                    "not kept", prepared.response.id, conversation_id)  # fmt: skip
