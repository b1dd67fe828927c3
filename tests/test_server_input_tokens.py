"""``POST /v1/responses/input_tokens`` (the SDK's ``responses.input_tokens.count``): the tokens
of the prompt a create request with the same fields would run."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from fastapi.testclient import TestClient

from gptoss_serve.config import ServerConfig
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import (
    REASONING_THEN_FINAL,
    TOOLS,
    ScriptedEngine,
    harmony_tokens,
    running_server,
)

COUNT = "/v1/responses/input_tokens"


def _count(client: TestClient, **body) -> int:
    response = client.post(COUNT, json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "response.input_tokens"
    return data["input_tokens"]


def test_the_count_is_the_prompt_a_create_runs(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    fields = {"input": "What is the weather in Oslo?", "instructions": "Be brief.",
              "tools": TOOLS, "reasoning": {"effort": "high"}}  # fmt: skip
    counted = _count(scripted_client, **fields)  # no model: the served one
    scripted_engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    created = scripted_client.post("/v1/responses", json={"model": "demo", **fields}).json()
    assert counted == len(scripted_engine.prompts[-1]) == created["usage"]["input_tokens"]
    assert _count(scripted_client, input="What is the weather in Oslo?") < counted
    # A continued conversation counts its history too.
    follow = {"input": "And tomorrow?", "previous_response_id": created["id"]}
    counted = _count(scripted_client, model="demo", **follow)
    scripted_engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    scripted_client.post("/v1/responses", json={"model": "demo", **follow})
    assert counted == len(scripted_engine.prompts[-1])
    assert len(scripted_engine.prompts) == 2  # counting ran nothing


def test_null_fields_are_not_given(scripted_client: TestClient) -> None:
    names = ("model", "instructions", "tools", "tool_choice", "text", "reasoning",
             "parallel_tool_calls", "previous_response_id", "truncation")  # fmt: skip
    nulls = dict.fromkeys(names)
    assert _count(scripted_client, input="Hi", **nulls) == _count(scripted_client, input="Hi")


def test_truncation_and_refusals(scripted_client: TestClient) -> None:
    long = [{"role": "user", "content": "word " * 40_000} for _ in range(4)]  # ~160k tokens
    refused = scripted_client.post(COUNT, json={"input": long})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert 0 < _count(scripted_client, input=long, truncation="auto") < 131072
    for body, status, param in (
        ({"input": "Hi", "model": "other"}, 404, "model"),
        ({"input": "Hi", "personality": "friendly"}, 400, "personality"),
        ({"input": "Hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({"input": []}, 400, "input"),
    ):
        response = scripted_client.post(COUNT, json=body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["param"] == param


@pytest.fixture()
def sdk() -> Iterator[openai.OpenAI]:
    app = create_app(ScriptedEngine(), ResponseStore(":memory:"), ServerConfig())
    with running_server(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_the_sdk_counts(sdk: openai.OpenAI) -> None:
    counted = sdk.responses.input_tokens.count(model="demo", input="Hi", tools=TOOLS)
    assert counted.object == "response.input_tokens" and counted.input_tokens > 10
