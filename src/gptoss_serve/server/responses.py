"""One response's orchestration: validate, render, generate, parse, emit events, store.

``prepare`` turns a request into everything generation needs or raises a 4xx APIError;
``run`` drives the engine and yields streaming events, leaving the final object in its state.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from gptoss_serve.config import SamplingParams, ServerConfig
from gptoss_serve.engine.client import EngineClient, EngineError
from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import (
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    Item,
    RenderRequest,
    ResponseFormat,
)
from gptoss_serve.harmony.parse import HarmonyStreamParser
from gptoss_serve.harmony.render import render_prompt
from gptoss_serve.server import events
from gptoss_serve.server.constraints import constraint_grammar, reasoning_budget
from gptoss_serve.server.conversation import (
    InputConverter,
    item_from_json,
    item_to_json,
    output_to_items,
)
from gptoss_serve.server.errors import APIError, bad_request
from gptoss_serve.server.metrics import RequestTimer, ServerMetrics
from gptoss_serve.server.objects import (
    IncompleteDetails,
    ResponseError,
    ResponseObject,
    Usage,
    new_id,
)
from gptoss_serve.server.protocol import (
    CreateResponseRequest,
    TextFormatJsonSchema,
    ToolChoiceAllowed,
    ToolChoiceFunction,
)
from gptoss_serve.server.store import ResponseStore

logger = logging.getLogger(__name__)

SUPPORTED_INCLUDES: frozenset[str] = frozenset()  # logprobs and encrypted reasoning: not yet


@dataclass
class Prepared:
    request: CreateResponseRequest
    response: ResponseObject
    prompt_ids: list[int]
    conversation: list[Item]  # previous + this request's input (what a follow-up continues)
    input_items: list[dict[str, Any]]
    params: SamplingParams
    state: events.StreamState = field(init=False)

    def __post_init__(self) -> None:
        self.state = events.StreamState(self.response)


def prepare(
    request: CreateResponseRequest, engine: EngineClient, store: ResponseStore, config: ServerConfig
) -> Prepared:
    """Check everything a client could get wrong; build the prompt. Raises APIError."""
    info = engine.info
    if request.model != info.model_name:
        raise APIError(
            404, f"The model '{request.model}' does not exist; this server serves "
            f"'{info.model_name}'.", param="model", code="model_not_found",
        )  # fmt: skip
    _check_unsupported(request)
    _check_values(request.model_dump(by_alias=True, exclude_unset=True))
    tools = _check_tools(request)
    history = _history(request, store)
    converter = InputConverter(history, store.item)
    if isinstance(request.input, str):
        converter.add_text(request.input)
    else:
        for index, raw in enumerate(request.input):
            converter.add(raw, f"input[{index}]")
    conversation = history + converter.items
    if not conversation:
        raise bad_request("The input must contain at least one item.", "input")
    render = RenderRequest(
        items=tuple(conversation),
        instructions=request.instructions,
        reasoning_effort=request.reasoning.effort or config.reasoning_effort,
        tools=tools,
        response_format=_response_format(request),
    )
    prompt_ids, render = _fit_context(render, request, info.max_context_tokens)
    room = info.max_context_tokens - len(prompt_ids)
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
    )
    response = ResponseObject(
        id=new_id("resp"),
        created_at=int(time.time()),
        status="in_progress",
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        metadata=request.metadata or {},
        model=info.model_name,
        parallel_tool_calls=request.parallel_tool_calls,
        previous_response_id=request.previous_response_id,
        reasoning=request.reasoning.model_copy(update={"effort": render.reasoning_effort}),
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
    return Prepared(request, response, prompt_ids, list(render.items), converter.listed, params)


def _check_unsupported(request: CreateResponseRequest) -> None:
    if request.background and not request.store:
        raise bad_request("Background responses must be stored: background requires store=true.",
                          "background")  # fmt: skip
    if request.top_logprobs:
        raise bad_request("top_logprobs is not supported by this server yet.", "top_logprobs",
                          "unsupported_parameter")  # fmt: skip
    for index, value in enumerate(request.include or ()):
        if value not in SUPPORTED_INCLUDES:
            raise bad_request(f"include value '{value}' is not supported by this server.",
                              f"include[{index}]", "unsupported_parameter")  # fmt: skip


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


def _check_tools(request: CreateResponseRequest) -> tuple[FunctionTool, ...]:
    names: dict[str, int] = {}
    for index, tool in enumerate(request.tools):
        if tool.name in names:
            raise bad_request(f"Duplicate tool name '{tool.name}'.", f"tools[{index}].name")
        names[tool.name] = index
    choice = request.tool_choice
    needs_tools = choice == "required" or isinstance(choice, ToolChoiceFunction | ToolChoiceAllowed)
    if needs_tools and not request.tools:
        raise bad_request("tool_choice requires at least one tool in 'tools'.", "tool_choice")
    if isinstance(choice, ToolChoiceFunction) and choice.name not in names:
        raise bad_request(f"Tool '{choice.name}' is not in 'tools'.", "tool_choice.name")
    if isinstance(choice, ToolChoiceAllowed):
        for index, ref in enumerate(choice.tools):
            if ref.name not in names:
                raise bad_request(f"Tool '{ref.name}' is not in 'tools'.",
                                  f"tool_choice.tools[{index}].name")  # fmt: skip
    return tuple(
        FunctionTool(t.name, t.description, t.parameters, bool(t.strict)) for t in request.tools
    )


def _history(request: CreateResponseRequest, store: ResponseStore) -> list[Item]:
    if request.previous_response_id is None:
        return []
    stored = store.conversation(request.previous_response_id)
    if stored is None:
        raise APIError(
            404, f"Previous response with id '{request.previous_response_id}' not found.",
            param="previous_response_id", code="previous_response_not_found",
        )  # fmt: skip
    return [item_from_json(entry) for entry in stored]


def _response_format(request: CreateResponseRequest) -> ResponseFormat | None:
    fmt = request.text.format
    if isinstance(fmt, TextFormatJsonSchema):
        return ResponseFormat(fmt.name, fmt.schema_, fmt.description, bool(fmt.strict))
    return None


def _fit_context(
    render: RenderRequest, request: CreateResponseRequest, context: int
) -> tuple[list[int], RenderRequest]:
    """Render; with truncation 'auto' drop the fewest oldest items that let a token of output
    fit. Dropping them one at a time rendered the whole conversation again for each (52 s of
    the event loop for 400 items of ~500 tokens over a 131k context): now a first guess from
    the items' sizes, then a search around it (``fewest_to_drop``), a render a try.

    Rendering holds the GIL (~0.2 s a MB of text, the event loop with it), so the items that
    cannot fit whatever the rest holds are refused (or, under 'auto', dropped) before any
    render, from a lower bound of their tokens (``_fewest_tokens``)."""
    render = _drop_certain_excess(render, request, context)
    prompt_ids = render_prompt(render)
    if len(prompt_ids) < context:
        return prompt_ids, render
    if request.truncation != "auto" or len(render.items) <= 1:
        raise _context_exceeded(len(prompt_ids), context)
    tried: dict[int, tuple[list[int], RenderRequest]] = {}

    def fits(count: int) -> bool:
        if count not in tried:
            fewer = RenderRequest(**{**render.__dict__, "items": render.items[count:]})
            tried[count] = (render_prompt(fewer), fewer)
        return len(tried[count][0]) < context

    last = len(render.items) - 1
    if not fits(last):  # even the newest item alone is too long
        raise _context_exceeded(len(tried[last][0]), context)
    # Tokens in proportion to the items' characters: the oldest items holding the excess.
    sizes = [_item_chars(item) for item in render.items]
    excess = (len(prompt_ids) - context + 1) * sum(sizes) / len(prompt_ids)
    guess, dropped = 0, 0
    while guess < last and dropped < excess:
        dropped += sizes[guess]
        guess += 1
    return tried[fewest_to_drop(last, fits, guess)]


def _drop_certain_excess(
    render: RenderRequest, request: CreateResponseRequest, context: int
) -> RenderRequest:
    """``render`` without its oldest items while the newer ones alone are sure to exceed the
    context; raises when no truncation is allowed or even the newest item is too long."""
    newest_first = [_fewest_tokens(item) for item in reversed(render.items)]
    total = sum(newest_first)
    if total < context:
        return render
    if request.truncation != "auto":
        raise _context_exceeded(total, context, at_least=True)
    kept, tokens = 0, 0
    while tokens + newest_first[kept] < context:  # ends: the sum of all of them does not fit
        tokens += newest_first[kept]
        kept += 1
    if kept == 0:
        raise _context_exceeded(newest_first[0], context, at_least=True)
    return RenderRequest(**{**render.__dict__, "items": render.items[-kept:]})


def _fewest_tokens(item: Item) -> int:
    """A lower bound of an item's tokens: o200k's longest token is 128 bytes, a character at
    least one byte."""
    return -(-_item_chars(item) // adapter.MAX_TOKEN_BYTES)


def fewest_to_drop(last: int, fits: Callable[[int], bool], guess: int) -> int:
    """The smallest count in 1..last for which ``fits`` holds, given that it holds for
    ``last``, not for 0, and for every count above one where it holds: the bracket around
    ``guess`` is found by doubling steps and closed by bisection (a good guess costs ~2
    calls, any guess O(log) calls; each count is asked at most once)."""
    guess = min(max(guess, 1), last)
    if fits(guess):
        above, step = guess, 1  # `above` fits; look below it
        while above - step > 0 and fits(above - step):
            above -= step
            step *= 2
        below = max(above - step, 0)  # does not fit (asked, or 0)
    else:
        below, step = guess, 1  # `below` does not fit; look above it
        while below + step < last and not fits(below + step):
            below += step
            step *= 2
        above = min(below + step, last)  # fits (asked, or last)
    while above - below > 1:
        middle = (below + above) // 2
        if fits(middle):
            above = middle
        else:
            below = middle
    return above


def _item_chars(item: Item) -> int:
    """Characters an item renders from, the rough measure of its tokens."""
    if isinstance(item, FunctionCall):
        return len(item.name) + len(item.arguments)
    if isinstance(item, FunctionCallOutput):
        return len(item.name) + len(item.output)
    return len(item.text)


def _context_exceeded(num_tokens: int, context: int, *, at_least: bool = False) -> APIError:
    count = f"at least {num_tokens}" if at_least else f"{num_tokens}"
    return bad_request(
        f"The input ({count} tokens) exceeds the context window of this model ({context} "
        "tokens).", "input", "context_length_exceeded",
    )  # fmt: skip


async def run(
    prepared: Prepared,
    engine: EngineClient,
    store: ResponseStore,
    metrics: ServerMetrics | None = None,
) -> AsyncIterator[dict]:
    """Generate and yield the events; the final object is ``prepared.response``. ``metrics``
    (the app's) gets the generation's tokens and latencies; one that does not reach its end
    (a client that left, a cancel) counts as ``cancelled``."""
    timer = RequestTimer(metrics)
    try:
        async for event in _run(prepared, engine, store, timer):
            yield event
    finally:
        if not timer.ended:
            timer.end("cancelled", len(prepared.prompt_ids), 0)


async def _run(
    prepared: Prepared, engine: EngineClient, store: ResponseStore, timer: RequestTimer
) -> AsyncIterator[dict]:
    state = prepared.state
    for event in events.start(state):
        yield event
    parser = HarmonyStreamParser()
    num_output = num_reasoning = 0
    last_token = None
    try:
        async for token in engine.generate(
            prepared.response.id, prepared.prompt_ids, prepared.params
        ):
            num_output += 1
            timer.token()
            last_token = token
            # A token is reasoning if it belongs to an analysis message: its header, its text
            # or the <|end|> that closes it (after which the channel reads None again).
            was_analysis = parser.current_channel == "analysis"
            parsed = parser.feed(token)
            if was_analysis or parser.current_channel == "analysis":
                num_reasoning += 1
            for item in parsed:
                for event in events.on_parse_event(state, item):
                    yield event
        # A message still open here was cut off: events.finish closes it as incomplete.
        _conclude(prepared, last_token)
    except EngineError as error:
        logger.error("response %s failed: %s", prepared.response.id, error)
        prepared.response.status = "failed"
        prepared.response.error = ResponseError(code="server_error", message=str(error))
    if parser.framing_error:
        logger.warning("response %s: model broke Harmony framing: %s",
                       prepared.response.id, parser.framing_error)  # fmt: skip
    cached = engine.cached_tokens(prepared.response.id)
    prepared.response.usage = Usage(
        input_tokens=len(prepared.prompt_ids),
        input_tokens_details={"cached_tokens": cached},
        output_tokens=num_output,
        output_tokens_details={"reasoning_tokens": num_reasoning},
        total_tokens=len(prepared.prompt_ids) + num_output,
    )
    final_events = events.finish(state)
    store_response(prepared, store)
    timer.end(prepared.response.status, len(prepared.prompt_ids), cached)
    for event in final_events:
        yield event


def _conclude(prepared: Prepared, last_token: int | None) -> None:
    if last_token is not None and last_token in prepared.params.stop_token_ids:
        prepared.response.status = "completed"
    else:  # ran out of tokens (max_output_tokens or the context)
        prepared.response.status = "incomplete"
        prepared.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")


def store_response(prepared: Prepared, store: ResponseStore) -> None:
    """The response, its input items and its conversation, if the request asked to store."""
    if not prepared.response.store:
        return
    response = prepared.response.dump()
    output = output_to_items(response["output"])
    conversation = [item_to_json(item) for item in [*prepared.conversation, *output]]
    store.put(response, prepared.input_items, conversation)
