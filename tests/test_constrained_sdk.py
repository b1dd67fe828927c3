"""The guarantees end to end: the real `openai` SDK, a real server, the random-weight demo model.

Over 200 requests, streaming and not: every completed json_schema answer validates with
`jsonschema` (and most complete, thanks to the reasoning budget); tool_choice required, a
named function and allowed_tools always call an allowed function with valid arguments; none
never calls; strict tools get valid arguments under auto too. Requests run 8 at a time.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response

from constrained_cases import SCHEMAS, TOOL_PARAMETERS, assert_valid_json, tools
from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.cpu_engine import CpuEngine
from gptoss_serve.model import load_model
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import running_server

logger = logging.getLogger(__name__)

pytestmark = pytest.mark.slow
NUM_PARALLEL = 8
REQUESTS_PER_SCHEMA = 6


@pytest.fixture(scope="module")
def client(demo_dir: Path) -> Iterator[openai.OpenAI]:
    engine = CpuEngine(load_model(demo_dir), "demo", max_active=NUM_PARALLEL)
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig())
    with running_server(app) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _respond(client: openai.OpenAI, request: dict[str, Any]) -> Response:
    """One request, streamed or not; the final response object either way."""
    if not request.get("stream"):
        return client.responses.create(**request)
    final = None
    for event in client.responses.create(**request):
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            final = event.response
    assert final is not None
    return final


def _run_all(client: openai.OpenAI, requests: list[dict[str, Any]]) -> list[Response]:
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(NUM_PARALLEL) as pool:
        responses = list(pool.map(lambda request: _respond(client, request), requests))
    logger.info("%d requests in %.1f s", len(requests), time.perf_counter() - started)
    for response in responses:
        assert response.status in ("completed", "incomplete"), response.error
    return responses


def _variant(index: int) -> dict[str, Any]:
    """Streaming every other request; the reasoning budget: the server's default for low
    effort (half of max_output_tokens here), a small one, or none at all."""
    budget = ({}, {"extra_body": {"reasoning_budget": 6}}, {"extra_body": {"reasoning_budget": 0}})
    return {
        "model": "demo",
        "stream": index % 2 == 1,
        "reasoning": {"effort": "low"},
        "max_output_tokens": 72,
        **budget[index % 3],
    }


def _message_text(response: Response) -> str:
    """The final answer's text. A preamble (a commentary message, which the grammar allows
    before the answer) may come first: it is a message item too, but not the answer."""
    messages = [item for item in response.output if item.type == "message"]
    assert messages and all(m.phase == "commentary" for m in messages[:-1]), response.output
    return "".join(part.text for part in messages[-1].content)


def _function_calls(response: Response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def test_json_schema_answers_validate(client: openai.OpenAI) -> None:
    requests = []
    for name, schema in SCHEMAS.items():
        for index in range(REQUESTS_PER_SCHEMA):
            fmt = {"type": "json_schema", "name": name, "schema": schema, "strict": index != 1}
            requests.append({**_variant(index), "input": f"Fill {name}.", "text": {"format": fmt}})
    responses = _run_all(client, requests)
    completed = [
        (request, response)
        for request, response in zip(requests, responses, strict=True)
        if response.status == "completed"
    ]
    for request, response in completed:
        assert_valid_json(_message_text(response), request["text"]["format"]["schema"])
    num_reasoning = sum(any(item.type == "reasoning" for item in r.output) for r in responses)
    logger.info("json_schema: %d requests over %d schemas, %d completed (all valid), "
                "%d with a reasoning item", len(requests), len(SCHEMAS), len(completed),
                num_reasoning)  # fmt: skip
    assert len(requests) >= 120 and len(SCHEMAS) >= 20
    assert len(completed) >= 0.8 * len(requests)


def test_json_object_answers_are_objects(client: openai.OpenAI) -> None:
    requests = [
        {**_variant(index), "input": "An object.", "text": {"format": {"type": "json_object"}}}
        for index in range(6)
    ]
    responses = _run_all(client, requests)
    completed = [response for response in responses if response.status == "completed"]
    for response in completed:
        assert isinstance(json.loads(_message_text(response)), dict)
    logger.info("json_object: %d requests, %d completed", len(requests), len(completed))


def _tool_requests(
    count: int, tool_choice: Callable[[int], Any], *, strict: bool = False, **extra: Any
) -> list[dict[str, Any]]:
    return [
        {
            **_variant(index),
            # Room for the longest turn the grammar allows: analysis at the default budget
            # (half of this), a preamble (<= 64 tokens), the call's header and its arguments
            # (< 64 tokens for these schemas); 96 let a random model run out before the call.
            "max_output_tokens": 320,
            "input": "Use a tool.",
            "tools": tools(strict=strict),
            "tool_choice": tool_choice(index),
            **extra,
        }
        for index in range(count)
    ]


def _check_single_call(response: Response, allowed: set[str]) -> str:
    assert response.status == "completed"
    (call,) = _function_calls(response)
    assert call.name in allowed
    assert_valid_json(call.arguments, TOOL_PARAMETERS[call.name])
    assert response.output[-1] is call  # the call ends the turn
    return call.name


def test_required_named_and_allowed_tools_always_call_validly(client: openai.OpenAI) -> None:
    names = sorted(TOOL_PARAMETERS)
    allowed = {"add", "set_flag"}
    allowed_choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": name} for name in sorted(allowed)],
    }
    required = _tool_requests(20, lambda index: "required")
    named = _tool_requests(12, lambda index: {"type": "function", "name": names[index % 4]})
    listed = _tool_requests(8, lambda index: allowed_choice)
    responses = _run_all(client, required + named + listed)
    called = [_check_single_call(response, set(names)) for response in responses[:20]]
    for index, response in enumerate(responses[20:32]):
        assert _check_single_call(response, {names[index % 4]}) == names[index % 4]
    for response in responses[32:]:
        _check_single_call(response, allowed)
    assert len(set(called)) > 1  # the grammar leaves the choice of function to the model
    logger.info("tool_choice required/named/allowed_tools: %d requests, all valid calls",
                len(responses))  # fmt: skip


def test_none_never_calls_and_strict_tools_are_valid_under_auto(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "flat", "schema": SCHEMAS["flat"], "strict": True}
    never = _tool_requests(10, lambda index: "none", text={"format": fmt})
    auto = _tool_requests(12, lambda index: "auto", strict=True, text={"format": fmt})
    responses = _run_all(client, never + auto)
    for response in responses[:10]:
        assert not _function_calls(response)
        if response.status == "completed":
            assert_valid_json(_message_text(response), SCHEMAS["flat"])
    num_calls = 0
    for response in responses[10:]:
        if response.status != "completed":
            continue
        if _function_calls(response):
            _check_single_call(response, set(TOOL_PARAMETERS))
            num_calls += 1
        else:
            assert_valid_json(_message_text(response), SCHEMAS["flat"])
    logger.info("tool_choice none: 10 requests, no call; auto with strict tools: %d calls",
                num_calls)  # fmt: skip


def test_without_a_format_the_items_are_well_formed(client: openai.OpenAI) -> None:
    """A plain response opens with its reasoning (closed at the budget), then the message;
    with a budget of 0 there is no reasoning item."""
    requests = [
        {**_variant(index), "input": "Hello!", "max_output_tokens": 24} for index in range(6)
    ]
    for request, response in zip(requests, _run_all(client, requests), strict=True):
        types = [item.type for item in response.output]
        no_reasoning = request.get("extra_body", {}).get("reasoning_budget") == 0
        assert types == (["message"] if no_reasoning else ["reasoning", "message"]), types
        if types[0] == "reasoning":
            assert response.output[0].status == "completed"
