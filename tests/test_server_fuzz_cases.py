"""Inputs a fuzz run of the server (1,891 requests against the demo model) answered with a 500,
a failed response or a stalled event loop: each now a 400 naming its field, or served.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from openai.types.responses import Response

from gptoss_serve.config import GREEDY_BELOW_TEMPERATURE, SamplingParams
from gptoss_serve.harmony.conversation import (
    FunctionTool,
    Message,
    RenderRequest,
    ResponseFormat,
)
from gptoss_serve.kernels.sampling import sample
from gptoss_serve.server import context_fit
from gptoss_serve.server.constraints import MAX_ENUM_VALUES
from gptoss_serve.server.protocol import MAX_SCHEMA_DEPTH, MAX_TOOLS, NULL_MEANS_DEFAULT
from gptoss_serve.server.render_workers import RENDER_IN_WORKER_CHARS
from server_helpers import TOOLS, ScriptedEngine, harmony_tokens
from test_server_errors import REPLY, assert_error, assert_healthy, make_client, with_base


@pytest.fixture()
def client() -> Iterator[TestClient]:
    with make_client(ScriptedEngine([harmony_tokens(REPLY)] * 4)) as test_client:
        yield test_client


def _tool(index: int, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    tool: dict[str, Any] = {"type": "function", "name": f"f{index}"}
    if parameters is not None:
        tool["parameters"] = parameters
    return tool


def _nested(levels: int) -> dict[str, Any]:
    """An object schema whose ``properties`` chain is ``levels`` objects deep (2 levels of JSON
    each)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _json_format(schema: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": strict}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # the grammar's unsigned 64-bit counter: 2**64 failed to compile, a server error
        (with_base(reasoning_budget=1 << 64), "reasoning_budget"),
        (with_base(reasoning_budget=1 << 31), "reasoning_budget"),
        # llguidance panicked on a class of 256 tool names
        (with_base(tools=[_tool(i) for i in range(MAX_TOOLS + 1)]), "tools"),
        # jsonschema's validator_for took a $schema that is not a string
        (with_base(tools=[_tool(0, {"$schema": 5, "type": "object"})]), "tools[0].parameters"),
        (with_base(tools=[_tool(0, {"$schema": [], "type": "object"})]), "tools[0].parameters"),
        (with_base(text=_json_format({"$schema": {}, "type": "object"})), "text.format.schema"),
        # Harmony's renderer refuses JSON past 128 levels; jsonschema's check overflows the stack
        (with_base(tools=[_tool(0, _nested(60))]), "tools[0].parameters"),
        (with_base(text=_json_format(_nested(100))), "text.format.schema"),
        # 2**70 was echoed back as max_output_tokens (past any 64-bit client's integer)
        (with_base(max_output_tokens=1 << 70), "max_output_tokens"),
        (with_base(max_output_tokens=1 << 31), "max_output_tokens"),
    ],
)
def test_was_a_server_error_now_a_400(client: TestClient, body: dict, param: str) -> None:
    assert_error(client.post("/v1/responses", json=body), 400, param)
    assert_healthy(client)


def test_the_limits_themselves_are_served(client: TestClient) -> None:
    deep = _nested(MAX_SCHEMA_DEPTH // 2 - 1)  # 62 levels of JSON
    body = with_base(tools=[_tool(i) for i in range(MAX_TOOLS - 1)] + [_tool(999, deep)],
                     reasoning_budget=(1 << 31) - 1)  # fmt: skip
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text


def test_null_is_the_default_where_the_sdk_allows_it(client: TestClient) -> None:
    """The SDK types these fields as optional; a client that sends every field, unset ones as
    null, used to get a 400 for each."""
    body = with_base(**dict.fromkeys(NULL_MEANS_DEFAULT), max_output_tokens=(1 << 31) - 1)
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert (data["store"], data["parallel_tool_calls"], data["truncation"]) == (
        True,
        True,
        "disabled",
    )
    assert data["background"] is False and data["reasoning"]["effort"] == "medium"
    retrieved = client.get(f"/v1/responses/{data['id']}")  # stored: store null is true
    assert retrieved.status_code == 200


def test_the_sdks_newer_harmless_fields_are_taken(client: TestClient) -> None:
    body = with_base(max_tool_calls=3, prompt_cache_retention="24h")
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["max_tool_calls"] == 3
    Response.model_validate(response.json())
    assert_error(client.post("/v1/responses", json=with_base(max_tool_calls=-1)), 400,
                 "max_tool_calls")  # fmt: skip


def _call_and_output(**extra: Any) -> list[dict[str, Any]]:
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "12 C"}
    return [{"role": "user", "content": "Weather?"}, {**call, **extra.get("call", {})},
            {**output, **extra.get("output", {})}]  # fmt: skip


def test_the_sdk_output_fields_of_calls_are_taken_back(client: TestClient) -> None:
    """``input += response.output`` with the SDK's objects dumped: their caller, namespace and
    async fields come back, null or a direct caller."""
    fields = {"caller": {"type": "direct"}, "namespace": None}
    items = _call_and_output(call={**fields, "async": False},
                             output={**fields, "name": "get_weather"})  # fmt: skip
    response = client.post("/v1/responses", json=with_base(input=items, tools=TOOLS))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"call": {"namespace": "not a name"}}, "input[1].namespace"),
        ({"call": {"async": True}}, "input[1].async"),
        ({"call": {"async": 0}}, "input[1].async"),  # not a bool (0 == False in Python)
        ({"output": {"caller": {"type": "program", "caller_id": "p"}}}, "input[2].caller.type"),
    ],
)
def test_calls_this_server_cannot_make_are_a_400(
    client: TestClient, extra: dict, param: str
) -> None:
    body = with_base(input=_call_and_output(**extra), tools=TOOLS)
    assert_error(client.post("/v1/responses", json=body), 400, param)


def test_an_unsupported_include_quoting_a_lone_surrogate_is_a_400(client: TestClient) -> None:
    # The include check quoted the value, and UTF-8 could not encode the error body.
    response = client.post(
        "/v1/responses",
        content=b'{"model": "demo", "input": "Hi", "include": ["\\ud800"]}',
        headers={"content-type": "application/json"},
    )
    assert_error(response, 400, "include[0]")
    assert_healthy(client)


def test_an_enforced_schema_with_more_enum_values_than_the_api_allows_is_a_400(
    client: TestClient,
) -> None:
    values = [f"v{i}" for i in range(MAX_ENUM_VALUES + 1)]
    schema = {"type": "object", "properties": {"a": {"enum": values}}, "required": ["a"]}
    response = client.post("/v1/responses", json=with_base(text=_json_format(schema)))
    assert_error(response, 400, "text.format.schema", "invalid_json_schema")
    assert str(MAX_ENUM_VALUES) in response.json()["error"]["message"]


def test_an_item_reference_to_a_stored_refusal_is_served(client: TestClient) -> None:
    refusal = {"type": "message", "id": "msg_refusal1", "role": "assistant",
               "content": [{"type": "refusal", "refusal": "no"}]}  # fmt: skip
    user = {"role": "user", "content": "x"}
    first = client.post("/v1/responses", json=with_base(input=[refusal, user]))
    assert first.status_code == 200, first.text
    second = client.post("/v1/responses", json=with_base(
        input=[{"type": "item_reference", "id": "msg_refusal1"}, {"role": "user", "content": "y"}]
    ))  # fmt: skip
    assert second.status_code == 200, second.text
    items = client.get(f"/v1/responses/{second.json()['id']}/input_items").json()["data"]
    assert {"type": "refusal", "refusal": "no"} in [
        part for item in items for part in item.get("content", [])
    ]


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 0.0, GREEDY_BELOW_TEMPERATURE / 2])
def test_temperatures_too_small_to_divide_by_sample_greedily(temperature: float) -> None:
    assert SamplingParams(temperature=temperature).temperature == 0.0
    logits = torch.tensor([1.0, 3.0, 3.0, -2.0])
    assert sample(logits, temperature=temperature, top_p=1.0, generator=None) == 1


def test_a_temperature_at_the_floor_still_samples() -> None:
    assert SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).temperature > 0


@pytest.mark.parametrize("top_p", [1e-300, 1e-40, 1e-9])
def test_a_top_p_below_the_top_token_keeps_the_top_token(top_p: float) -> None:
    # 1e-300 is 0 in fp32, and the top token's mass before it (0) then compared as >= top_p.
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.5, 2.0, 1.0])
    for _ in range(5):
        assert sample(logits, temperature=1.0, top_p=top_p, generator=generator) == 1


def test_items_instructions_and_tools_count_towards_the_render_in_a_worker() -> None:
    # 600,000 empty messages rendered on the event loop (66 s): their texts have no characters.
    empty = RenderRequest(items=tuple(Message("user", "") for _ in range(1000)))
    assert context_fit.input_chars(empty.items) == 0
    assert context_fit.render_chars(empty) > RENDER_IN_WORKER_CHARS
    long_text = "x" * RENDER_IN_WORKER_CHARS
    one = (Message("user", "Hi"),)
    assert context_fit.render_chars(RenderRequest(one, instructions=long_text)) > len(long_text)
    tool = FunctionTool("f", long_text, {"type": "object"})
    assert context_fit.render_chars(RenderRequest(one, tools=(tool,))) > len(long_text)
    schema = {"enum": [long_text]}
    request = RenderRequest(one, response_format=ResponseFormat("x", schema))
    assert context_fit.render_chars(request) > len(long_text)
    assert context_fit.render_chars(RenderRequest(one)) < RENDER_IN_WORKER_CHARS
