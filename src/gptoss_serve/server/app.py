"""The FastAPI application: routes, SSE, and nothing else (the engine client is injected)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gptoss_serve import __version__
from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.client import EngineClient
from gptoss_serve.gc_heap import frozen_startup_heap
from gptoss_serve.harmony.replay import GeneratedMessages
from gptoss_serve.server import constraints
from gptoss_serve.server.api_keys import ApiKeyAuth
from gptoss_serve.server.background import BackgroundRuns
from gptoss_serve.server.body_limit import BodyLimit
from gptoss_serve.server.chat_routes import ChatServices, add_chat_routes
from gptoss_serve.server.compaction import (
    Services,
    compacted,
    compacting_preparer,
    prepare_compaction,
)
from gptoss_serve.server.conversation_locks import ConversationLocks
from gptoss_serve.server.conversation_routes import add_conversation_routes
from gptoss_serve.server.cors import OpenAICors
from gptoss_serve.server.disconnect import CLIENT_CLOSED_REQUEST, unless_client_leaves
from gptoss_serve.server.errors import bad_request, install_error_handlers, not_found
from gptoss_serve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gptoss_serve.server.metrics import ServerMetrics
from gptoss_serve.server.objects import (
    CompactedResponseObject,
    DeletedResponse,
    ErrorResponse,
    InputItemList,
    InputTokenCount,
    ModelList,
    ModelObject,
    ResponseObject,
)
from gptoss_serve.server.protocol import (
    CompactRequest,
    CreateResponseRequest,
    InputTokenCountRequest,
)
from gptoss_serve.server.render_workers import RenderWorkers
from gptoss_serve.server.request_ids import RequestIds
from gptoss_serve.server.responses import Prepared, count_input_tokens, prepare, run
from gptoss_serve.server.retention import pruning
from gptoss_serve.server.sse import JSON, sse_response
from gptoss_serve.server.store import ResponseStore

logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 500)}
_SSE_DOC = {
    200: {
        "description": "The response object, or with `stream: true` a text/event-stream of "
        "response events ending with response.completed, .incomplete or .failed.",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


def create_app(engine: EngineClient, store: ResponseStore, config: ServerConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(constraints.warm_up, config)  # not in the first request
        await renderers.start()  # nor the render workers' start (render_workers.py)
        async with pruning(store, config.store_retention_s, config.store_prune_interval_s):
            with frozen_startup_heap():  # full collections skip what start-up built (gc_heap.py)
                yield
        await _shut_down(runs, engine, renderers, store)

    replays = GeneratedMessages(config.replay_cache_tokens)  # harmony/replay.py
    metrics = ServerMetrics(engine.stats, replays.stats)
    runs = BackgroundRuns(engine, store, metrics)
    renderers = RenderWorkers(config.render_processes)
    locks = ConversationLocks()
    services = Services(engine, store, config, renderers, replays, metrics)  # compaction.py

    app = FastAPI(title="gptoss-serve", version=__version__, lifespan=lifespan)
    _add_middleware(app, config)
    install_error_handlers(app)
    served = config.served_model_ids(engine.info.model_name)
    models = [ModelObject(id=name, created=engine.info.created_at) for name in served]

    @app.post("/v1/responses", response_model=ResponseObject,
              responses={**_ERRORS, 413: {"model": ErrorResponse}, **_SSE_DOC})  # fmt: skip
    async def create_response(body: CreateResponseRequest, request: Request):
        _check_previous_ended(runs, body.previous_response_id)
        prepared = await prepare(
            body, engine, store, config, renderers, locks=locks, replays=replays,
            compactor=compacting_preparer(body, services),
        )  # fmt: skip
        if body.background:  # runs on without this request; its events are kept
            background = runs.start(prepared)
            if body.stream:
                return _event_stream(background.follow())
            return JSONResponse(background.snapshot())
        if body.stream:  # StreamingResponse itself stops the stream when the client leaves
            return _event_stream(run(prepared, engine, store, metrics))
        if not await unless_client_leaves(_complete(prepared, engine, store, metrics), request):
            logger.info("response %s: the client left; generation stopped", prepared.response.id)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(prepared.response.dump())

    @app.post("/v1/responses/input_tokens", response_model=InputTokenCount,
              responses={**_ERRORS, 413: {"model": ErrorResponse}})  # fmt: skip
    async def count_tokens(body: InputTokenCountRequest) -> InputTokenCount:
        request = body.as_create_request(engine.info.model_name)
        _check_previous_ended(runs, request.previous_response_id)
        count = await count_input_tokens(request, engine, store, config, renderers, replays=replays)
        return InputTokenCount(input_tokens=count)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_ERRORS)
    async def get_response(
        response_id: str, stream: bool = False, starting_after: Annotated[int, Query(ge=-1)] = -1
    ):
        return _get_response(runs, store, response_id, stream, starting_after)

    @app.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject,
              responses=_ERRORS)  # fmt: skip
    async def cancel_response(response_id: str):
        background = runs.get(response_id)
        if background is None:
            _stored_or_404(store, response_id)
            raise bad_request("Only background responses can be cancelled.", "response_id")
        return JSONResponse(await runs.cancel(background))

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=_ERRORS)
    async def delete_response(response_id: str) -> DeletedResponse:
        # A background run still going would store the object again when it ends, and its
        # kept events would still stream: stopped and forgotten first.
        await runs.forget(response_id)
        if not store.delete(response_id):
            raise not_found(f"Response with id '{response_id}' not found.", "response_id")
        return DeletedResponse(id=response_id)

    _add_compact_route(app, runs, services)
    _add_input_items_route(app, store)
    add_conversation_routes(app, store, locks)
    add_chat_routes(app, ChatServices(engine, store, config, renderers, locks, metrics, replays))
    _add_service_routes(app, models, metrics, engine)
    return app


def _add_compact_route(app: FastAPI, runs: BackgroundRuns, services: Services) -> None:
    @app.post("/v1/responses/compact", response_model=CompactedResponseObject,
              responses={**_ERRORS, 413: {"model": ErrorResponse}})  # fmt: skip
    async def compact_conversation(body: CompactRequest, request: Request):
        _check_previous_ended(runs, body.previous_response_id)
        compacting = await prepare_compaction(body, services)
        done = _complete(compacting.prepared, services.engine, services.store, services.metrics)
        if not await unless_client_leaves(done, request):
            logger.info("compaction %s: the client left; generation stopped",
                        compacting.prepared.response.id)  # fmt: skip
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(compacted(compacting, services.metrics).model_dump(mode="json"))


def _add_input_items_route(app: FastAPI, store: ResponseStore) -> None:
    @app.get(
        "/v1/responses/{response_id}/input_items",
        response_model=InputItemList,
        responses=_ERRORS,
    )
    async def list_input_items(
        response_id: str,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> InputItemList:
        items = store.input_items(response_id)
        if items is None:
            raise not_found(f"Response with id '{response_id}' not found.", "response_id")
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise not_found(f"Item with id '{after}' not found.", "after")
            items = items[ids.index(after) + 1 :]
        return InputItemList.page(items[:limit], has_more=len(items) > limit)


def _add_middleware(app: FastAPI, config: ServerConfig) -> None:
    """The body limit; outside it (added later, so run earlier) the API keys' check, so that
    a 401 reads no body; outermost CORS, which answers preflights (they carry no key) and
    adds its headers to every answer, 401s included; around all, the request ids."""
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    if config.api_keys:
        app.add_middleware(ApiKeyAuth, keys=config.api_keys)
    if config.allowed_origins:
        app.add_middleware(OpenAICors, origins=config.allowed_origins)
    app.add_middleware(RequestIds)  # outermost: every answer carries its id


def _add_service_routes(
    app: FastAPI, models: list[ModelObject], metrics: ServerMetrics, engine: EngineClient
) -> None:
    """The model list (the served model under each of its ids), the Prometheus metrics and
    the liveness check (503 once the engine has failed for good, so that a supervisor restarts
    the server rather than send it requests that can only fail)."""
    by_id = {model.id: model for model in models}

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=models)

    # `:path`: ids such as "openai/gpt-oss-120b" hold a slash, which the SDK sends unquoted
    @app.get("/v1/models/{model_id:path}", response_model=ModelObject, responses=_ERRORS)
    async def get_model(model_id: str) -> ModelObject:
        if model_id not in by_id:
            raise not_found(f"The model '{model_id}' does not exist.", "model_id")
        return by_id[model_id]

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/health")
    @app.get("/healthz")
    async def health() -> JSONResponse:
        failure = engine.failure()
        if failure is not None:
            return JSONResponse({"status": "unhealthy", "reason": failure}, status_code=503)
        return JSONResponse({"status": "ok"})


async def _shut_down(
    runs: BackgroundRuns, engine: EngineClient, renderers: RenderWorkers, store: ResponseStore
) -> None:
    """The background runs first (they use the engine and the store), the store last."""
    await runs.close()
    await engine.close()
    renderers.close()
    store.close()


async def _complete(
    prepared: Prepared, engine: EngineClient, store: ResponseStore, metrics: ServerMetrics
) -> None:
    """A non-streaming response, generated to its end (``prepared.response`` holds it)."""
    async for _ in run(prepared, engine, store, metrics):
        pass


def _event_stream(source: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    return sse_response(_sse(source))


async def _sse(source: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """``event: <type>`` + ``data: <json>`` + a blank line per event; no [DONE]."""
    async for event in source:
        yield f"event: {event['type']}\ndata: {JSON.encode(event)}\n\n"


def _get_response(
    runs: BackgroundRuns, store: ResponseStore, response_id: str, stream: bool, after: int
) -> Response:
    """A response as it stands (a running background one's live object), or with ``stream``
    a background response's events after ``after``, then the live ones."""
    background = runs.get(response_id)
    if stream:
        if background is None:
            _stored_or_404(store, response_id)
            message = ("Only a background response's events can be streamed again (and only "
                       "by the server process that ran it).")  # fmt: skip
            raise bad_request(message, "stream")
        last = len(background.events) - 1
        if background.done and after > last:  # a running one's later events are yet to come
            raise bad_request(f"starting_after {after} is past this response's last event, "
                              f"sequence number {last}.", "starting_after")  # fmt: skip
        return _event_stream(background.follow(after))
    if background is not None and not background.done:
        return JSONResponse(background.snapshot())
    return JSONResponse(_stored_or_404(store, response_id))


def _check_previous_ended(runs: BackgroundRuns, previous_id: str | None) -> None:
    """A background response still running has no conversation to continue yet."""
    background = None if previous_id is None else runs.get(previous_id)
    if background is not None and not background.done:
        raise bad_request(f"Previous response '{previous_id}' is a background response still "
                          f"{background.prepared.response.status}; continue from it once it "
                          "has ended.", "previous_response_id")  # fmt: skip


def _stored_or_404(store: ResponseStore, response_id: str) -> dict[str, Any]:
    stored = store.get(response_id)
    if stored is None:
        raise not_found(f"Response with id '{response_id}' not found.", "response_id")
    return stored


__all__ = ["create_app"]
