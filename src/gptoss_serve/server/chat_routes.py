"""``POST /v1/chat/completions``: the Chat Completions API over the Responses machinery.

A chat request is translated into the Responses request that makes the same prompt
(chat_protocol.py), prepared and run as one (responses.py: the same checks, Harmony rendering,
grammar constraints, engine and metrics; never stored), and its events or final object are
turned into chat chunks or a ``chat.completion`` (chat_events.py). A 4xx names the chat
request's field, not the Responses one it was checked as.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.client import EngineClient
from gptoss_serve.harmony.replay import GeneratedMessages
from gptoss_serve.server.chat_choices import fork, merged
from gptoss_serve.server.chat_events import (
    ChatStreamState,
    chunks_for,
    completion,
    completion_choice,
    usage_chunk,
)
from gptoss_serve.server.chat_protocol import (
    ChatCompletionRequest,
    Translation,
    chat_param,
    to_responses,
)
from gptoss_serve.server.conversation_locks import ConversationLocks
from gptoss_serve.server.disconnect import CLIENT_CLOSED_REQUEST, unless_client_leaves
from gptoss_serve.server.errors import APIError, from_validation_error
from gptoss_serve.server.metrics import ServerMetrics
from gptoss_serve.server.objects import ErrorResponse, ResponseObject
from gptoss_serve.server.protocol import CreateResponseRequest
from gptoss_serve.server.render_workers import RenderWorkers
from gptoss_serve.server.responses import Prepared, prepare, run
from gptoss_serve.server.sse import JSON, sse_response
from gptoss_serve.server.stop_sequences import StopSequences
from gptoss_serve.server.store import ResponseStore

logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500)}
SEED_RANGE = 1 << 62  # the engines' seeds: an int64 one is taken modulo this


@dataclasses.dataclass(frozen=True)
class ChatServices:
    """What a chat completion needs of the app (the same objects the Responses routes use)."""

    engine: EngineClient
    store: ResponseStore
    config: ServerConfig
    renderers: RenderWorkers
    locks: ConversationLocks
    metrics: ServerMetrics
    replays: GeneratedMessages


def add_chat_routes(app: FastAPI, services: ChatServices) -> None:
    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        prepared = await _prepare(body, services)
        choices = fork(prepared, body.n or 1, SEED_RANGE)
        first = ChatStreamState(model=prepared.response.model)  # the completion's id and time
        states = [first, *(ChatStreamState(first.model, first.id, first.created, index)
                           for index in range(1, len(choices)))]  # fmt: skip
        if body.stop:  # a choice's generation ends once its answer's text holds one
            stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
            for state, choice in zip(states, choices, strict=True):
                state.stops = stops = StopSequences(stop)
                choice.stop_when = lambda stops=stops: stops.stopped
        engine, store, metrics = services.engine, services.store, services.metrics
        events = merged(choices, lambda one: run(one, engine, store, metrics))
        responses = [choice.response for choice in choices]
        if body.stream:
            include = body.stream_options is not None and bool(body.stream_options.include_usage)
            return sse_response(_sse(states, events, responses if include else None))
        if not await unless_client_leaves(_drain(states, events), request):
            logger.info("chat completion %s: the client left; generation stopped", first.id)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        dumped = [response.dump() for response in responses]
        for response in dumped:
            if response["status"] == "failed":
                error = response.get("error") or {}
                raise APIError(500, error.get("message", "generation failed"),
                               code="server_error", error_type="server_error")  # fmt: skip
        logprobs = bool(body.logprobs)
        made = [completion_choice(state, response, logprobs)
                for state, response in zip(states, dumped, strict=True)]  # fmt: skip
        return JSONResponse(completion(first, made, dumped))


async def _prepare(body: ChatCompletionRequest, services: ChatServices) -> Prepared:
    """The Responses preparation of the translated request; its 4xx name the chat fields."""
    translation = to_responses(body)
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    try:
        request = _responses_request(translation)
        prepared = await prepare(request, services.engine, services.store, services.config,
                                 services.renderers, locks=services.locks,
                                 replays=services.replays)  # fmt: skip
    except APIError as error:
        param = chat_param(error.param, translation, name)
        if error.param and param != error.param:  # the message quotes it too, at times
            error.message = error.message.replace(f"'{error.param}'", f"'{param}'")
        error.param = param
        raise
    if body.seed is not None:  # Responses requests have no seed; the engines take one
        prepared.params = dataclasses.replace(prepared.params, seed=body.seed % SEED_RANGE)
    return prepared


def _responses_request(translation: Translation) -> CreateResponseRequest:
    """Validated as a Responses request (what the chat models let through: the same checks),
    then given the chat request's output cap, which may be under the Responses API's floor."""
    try:
        request = CreateResponseRequest.model_validate(translation.body)
    except ValidationError as error:
        located = [{**problem, "loc": ("body", *problem["loc"])} for problem in error.errors()]
        raise from_validation_error(RequestValidationError(located), translation.body) from None
    if translation.max_tokens is not None:
        request = request.model_copy(update={"max_output_tokens": translation.max_tokens})
    return request


async def _drain(
    states: list[ChatStreamState], events: AsyncIterator[tuple[int, dict[str, Any]]]
) -> None:
    """A non-streamed run to its end, its events through the chunks' states all the same (the
    stop sequences are matched there); a failed choice ends it (the others are stopped)."""
    async with contextlib.aclosing(events):
        async for index, event in events:
            chunks_for(states[index], event)
            if event["type"] == "response.failed":
                break


async def _sse(
    states: list[ChatStreamState],
    events: AsyncIterator[tuple[int, dict[str, Any]]],
    usage_of: list[ResponseObject] | None,
) -> AsyncIterator[str]:
    """``data: <chunk>`` blocks (each choice's under its index), the usage chunk if asked for
    (``usage_of``: the choices' responses), then ``data: [DONE]``, as the official stream
    ends. An error chunk ends the stream: the other choices are stopped."""
    failed = False
    async with contextlib.aclosing(events):
        async for index, event in events:
            for chunk in chunks_for(states[index], event):
                yield f"data: {JSON.encode(chunk)}\n\n"
            if event["type"] == "response.failed":
                failed = True
                break
    if usage_of is not None and not failed:
        usage = usage_chunk(states[0], [response.dump() for response in usage_of])
        yield f"data: {JSON.encode(usage)}\n\n"
    yield "data: [DONE]\n\n"
