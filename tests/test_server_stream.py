"""Streaming events against the official shapes and ordering rules, event by event.

Scripted token sequences (tests/server_helpers.ScriptedEngine) make the model's output
exact, so every case of the Harmony -> items mapping is pinned down.
"""

from __future__ import annotations

import json
import time
import typing
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent

from gptoss_serve.config import ServerConfig
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import (
    PREAMBLE_AND_CALL,
    REASONING_THEN_FINAL,
    RECIPIENT_IN_ROLE,
    REFUSAL_NO_CHANNEL,
    STRAY_AFTER_MESSAGE,
    TOOLS,
    ScriptedEngine,
    harmony_tokens,
    running_server,
)

# The SDK's event union, keyed by each member's `type` literal (strict validation per type).
EVENT_TYPES = {
    typing.get_args(model.model_fields["type"].annotation)[0]: model
    for model in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


@pytest.fixture()
def engine(scripted_engine: ScriptedEngine) -> ScriptedEngine:
    return scripted_engine


@pytest.fixture()
def client(scripted_client: TestClient) -> TestClient:
    return scripted_client


def sse_events(text: str) -> list[dict[str, Any]]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        event = json.loads(lines[1].removeprefix("data: "))
        assert event["type"] == lines[0].removeprefix("event: ")
        events.append(event)
    return events


def check_sequence(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Assert the official ordering rules; return the terminal event's response."""
    for event in events:
        EVENT_TYPES[event["type"]].model_validate(event)  # a valid SDK ResponseStreamEvent
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    assert events[1]["type"] == "response.in_progress"
    assert [e["type"] in TERMINAL for e in events].count(True) == 1
    assert events[-1]["type"] in TERMINAL
    final = events[-1]["response"]
    Response.model_validate(final)

    open_item: dict[str, Any] | None = None
    next_index = 0
    phase = ""
    done_items = []
    for event in events[2:-1]:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert open_item is None, "an item opened before the previous one closed"
            assert event["output_index"] == next_index
            open_item = event["item"]
            assert open_item["status"] == "in_progress"
            phase = "added"
            continue
        assert open_item is not None, f"{kind} outside an item"
        assert event["output_index"] == next_index
        if "item_id" in event:
            assert event["item_id"] == open_item["id"]
        if "content_index" in event:
            assert event["content_index"] == 0
        if kind == "response.content_part.added":
            assert phase == "added" and open_item["type"] != "function_call"
            phase = "part"
        elif kind.endswith(".delta"):
            assert phase in ("part", "delta", "added")
            if open_item["type"] == "function_call":
                assert kind == "response.function_call_arguments.delta"
            phase = "delta"
        elif kind in (
            "response.output_text.done",
            "response.reasoning_text.done",
            "response.function_call_arguments.done",
        ):
            phase = "text_done"
        elif kind == "response.content_part.done":
            assert phase == "text_done"
            phase = "part_done"
        elif kind == "response.output_item.done":
            item = event["item"]
            assert item["id"] == open_item["id"] and item["type"] == open_item["type"]
            if item["type"] == "function_call":
                assert item["call_id"] == open_item["call_id"] and phase == "text_done"
            else:
                assert phase == "part_done"
            done_items.append(item)
            open_item = None
            next_index += 1
        else:
            raise AssertionError(f"unexpected event {kind}")
    assert open_item is None
    assert final["output"] == done_items
    return final


def _stream(client: TestClient, **body: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    payload = {"model": "demo", "input": "Hi", "stream": True, **body}
    with client.stream("POST", "/v1/responses", json=payload) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = sse_events(text)
    return events, check_sequence(events)


def _texts(final: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for item in final["output"]:
        if item["type"] == "function_call":
            out.append(("function_call", f"{item['name']} {item['arguments']}"))
        else:
            out.append((item["type"], item["content"][0]["text"]))
    return out


def test_reasoning_then_final(client: TestClient, engine: ScriptedEngine) -> None:
    engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    events, final = _stream(client)
    assert final["status"] == "completed"
    assert _texts(final) == [
        ("reasoning", "The user greets. Reply."),
        ("message", "Hello there, friend! 👋"),
    ]
    types = [e["type"] for e in events]
    assert types[:6] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta",
    ]  # fmt: skip
    usage = final["usage"]
    assert usage["output_tokens"] == len(engine.last_script)
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_preamble_and_function_call(client: TestClient, engine: ScriptedEngine) -> None:
    engine.queue(harmony_tokens(PREAMBLE_AND_CALL))
    events, final = _stream(client, tools=TOOLS)
    assert _texts(final) == [
        ("reasoning", "Need weather."),
        ("message", "Let me check."),
        ("function_call", 'get_weather {"city": "Oslo"}'),
    ]
    call = final["output"][2]
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done[0]["name"] == "get_weather" and done[0]["arguments"] == '{"city": "Oslo"}'
    assert not [e for e in events if e["type"].startswith("response.content_part") and
                e["output_index"] == 2]  # fmt: skip


def test_recipient_in_the_role_part(client: TestClient, engine: ScriptedEngine) -> None:
    engine.queue(harmony_tokens(RECIPIENT_IN_ROLE))
    _, final = _stream(client, tools=TOOLS)
    assert _texts(final)[-1] == ("function_call", 'get_weather {"city": "Rome"}')


def test_refusal_without_channel_is_a_message(client: TestClient, engine: ScriptedEngine) -> None:
    engine.queue(harmony_tokens(REFUSAL_NO_CHANNEL))
    _, final = _stream(client, max_output_tokens=16)  # more than the script: it ends first
    assert _texts(final) == [("message", "I can't help with that.")]


def test_stray_token_after_a_message_is_not_an_error(
    client: TestClient, engine: ScriptedEngine
) -> None:
    engine.queue(harmony_tokens(STRAY_AFTER_MESSAGE))
    _, final = _stream(client)
    assert final["status"] == "completed"
    assert _texts(final) == [("reasoning", "Hmm."), ("message", "Done.")]


def test_max_output_tokens_gives_incomplete(client: TestClient, engine: ScriptedEngine) -> None:
    reasoning = "The user greets me warmly and wants a short, friendly reply back, so I answer"
    reasoning += " with one cheerful word"
    engine.queue(
        harmony_tokens(
            f"<|channel|>analysis<|message|>{reasoning}.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hi!<|return|>"
        )
    )
    # Cut inside the reasoning text (at least 16 tokens: the smallest max_output_tokens):
    # the open item ends "incomplete".
    head = "The user greets me warmly and wants a short, friendly reply back"
    cut = len(harmony_tokens(f"<|channel|>analysis<|message|>{head}"))
    assert cut >= 16
    events, final = _stream(client, max_output_tokens=cut)
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete"
    assert final["output"][-1]["status"] == "incomplete"
    assert final["output"][-1]["content"][0]["text"] == head
    assert final["usage"]["output_tokens"] == cut


def test_stream_and_non_stream_agree(client: TestClient, engine: ScriptedEngine) -> None:
    engine.queue(harmony_tokens(PREAMBLE_AND_CALL), harmony_tokens(PREAMBLE_AND_CALL))
    _, streamed = _stream(client, tools=TOOLS)
    plain = client.post(
        "/v1/responses", json={"model": "demo", "input": "Hi", "tools": TOOLS}
    ).json()
    Response.model_validate(plain)
    assert _texts(plain) == _texts(streamed)
    assert plain["usage"] == streamed["usage"]
    stored = client.get(f"/v1/responses/{streamed['id']}").json()
    assert stored == streamed  # the stored object is the streamed final object


def test_client_disconnect_aborts_generation() -> None:
    engine = ScriptedEngine([harmony_tokens("<|channel|>analysis<|message|>" + "word " * 400)])
    engine.delay = 0.01
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig())
    with running_server(app) as base_url:
        payload = {"model": "demo", "input": "Hi", "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/responses", json=payload) as response:
            for count, _ in enumerate(response.iter_lines()):
                if count > 20:
                    break
        # The server notices the closed connection and stops generating.
        for _ in range(200):
            if engine.aborted:
                break
            time.sleep(0.02)
    assert len(engine.aborted) == 1


def test_client_disconnect_aborts_a_non_streaming_response() -> None:
    """A client that gives up on a plain (non-streaming) request (a timeout, a closed socket)
    frees the engine at once: the generation stops instead of running to max_output_tokens."""
    engine = ScriptedEngine([harmony_tokens("<|channel|>analysis<|message|>" + "word " * 400)])
    engine.delay = 0.01  # ~4 s of tokens
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig())
    with running_server(app) as base_url:
        payload = {"model": "demo", "input": "Hi"}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base_url}/v1/responses", json=payload, timeout=0.3)
        for _ in range(100):  # 2 s: well before the script's end
            if engine.aborted:
                break
            time.sleep(0.02)
    assert len(engine.aborted) == 1
