"""The hint fields a request may carry come back on the response object, as the official API
echoes them, and `completed_at` marks a completed response (only those)."""

from __future__ import annotations

import json
import time

from fastapi.testclient import TestClient
from openai.types.responses import Response

from server_helpers import REASONING_THEN_FINAL, ScriptedEngine, harmony_tokens

HINTS = {
    "prompt_cache_key": "conversation-42",
    "prompt_cache_retention": "24h",
    "safety_identifier": "user-hash-1",
    "service_tier": "flex",
}


def test_hints_are_echoed_and_completed_at_is_set(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    scripted_engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    before = int(time.time())
    body = {"model": "demo", "input": "Hi", "max_output_tokens": 64, **HINTS,
            "reasoning": {"generate_summary": "concise"}}  # fmt: skip
    created = scripted_client.post("/v1/responses", json=body)
    assert created.status_code == 200
    response = created.json()
    assert {key: response[key] for key in HINTS} == HINTS
    assert response["reasoning"]["generate_summary"] == "concise"
    assert response["status"] == "completed"
    assert before <= response["completed_at"] <= int(time.time())
    assert response["completed_at"] >= response["created_at"]
    Response.model_validate(response)  # the SDK's own type, strictly
    stored = scripted_client.get(f"/v1/responses/{response['id']}").json()
    assert stored["completed_at"] == response["completed_at"]
    assert stored["prompt_cache_key"] == HINTS["prompt_cache_key"]


def test_no_completed_at_unless_completed(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    scripted_engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    cut = scripted_client.post(
        "/v1/responses", json={"model": "demo", "input": "Hi", "max_output_tokens": 16}
    ).json()
    assert cut["status"] == "incomplete" and cut["completed_at"] is None
    assert cut["prompt_cache_key"] is None and cut["safety_identifier"] is None


def test_streamed_terminal_event_carries_completed_at(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    scripted_engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    body = {"model": "demo", "input": "Hi", "max_output_tokens": 64, "stream": True}
    with scripted_client.stream("POST", "/v1/responses", json=body) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert events[0]["response"]["completed_at"] is None
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["completed_at"] is not None
