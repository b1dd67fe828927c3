"""Response persistence: SQLite survives a restart, previous_response_id continues the stored
conversation (input and output, not instructions), input_items paginates, and ResponseStore
itself round-trips."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gptoss_serve.config import ServerConfig
from gptoss_serve.harmony.adapter import decode
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import ScriptedEngine, harmony_tokens

REPLY = (
    "<|channel|>analysis<|message|>Thinking.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
)
WEATHER_CALL = (
    "<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Oslo"}<|call|>'
)
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def make_client(engine: ScriptedEngine, store_path: str | Path = ":memory:") -> TestClient:
    return TestClient(create_app(engine, ResponseStore(store_path), ServerConfig()))


def create(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/responses", json={"model": "demo", **fields})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture()
def engine() -> ScriptedEngine:
    return ScriptedEngine([harmony_tokens(REPLY)])


@pytest.fixture()
def client(engine: ScriptedEngine) -> Iterator[TestClient]:
    with make_client(engine) as test_client:
        yield test_client


# -- (a) restart -----------------------------------------------------------------------------


def test_stored_response_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "state" / "responses.sqlite"
    with make_client(ScriptedEngine([harmony_tokens(REPLY)]), path) as first:
        created = create(first, input="Remember the word 'tangerine'.", metadata={"run": "1"})
        items_before = first.get(f"/v1/responses/{created['id']}/input_items").json()
    assert path.exists()

    engine = ScriptedEngine([harmony_tokens(REPLY)])
    with make_client(engine, path) as second:
        fetched = second.get(f"/v1/responses/{created['id']}")
        assert fetched.status_code == 200
        assert fetched.json() == created

        items = second.get(f"/v1/responses/{created['id']}/input_items").json()
        assert items == items_before
        assert [item["content"] for item in items["data"]] == [
            [{"type": "input_text", "text": "Remember the word 'tangerine'."}]
        ]

        # The stored conversation is still continuable after the restart.
        create(second, input="Which word?", previous_response_id=created["id"])
        prompt = decode(engine.prompts[-1])
        assert "tangerine" in prompt
        assert "Hello!" in prompt

        deleted = second.delete(f"/v1/responses/{created['id']}")
        assert deleted.status_code == 200
        assert deleted.json() == {"id": created["id"], "object": "response", "deleted": True}
        assert second.get(f"/v1/responses/{created['id']}").status_code == 404
        assert second.get(f"/v1/responses/{created['id']}/input_items").status_code == 404
        assert second.delete(f"/v1/responses/{created['id']}").status_code == 404

    with make_client(ScriptedEngine(), path) as third:
        assert third.get(f"/v1/responses/{created['id']}").status_code == 404


# -- (b) store: false ------------------------------------------------------------------------


def test_unstored_response_cannot_be_fetched_or_continued(client: TestClient) -> None:
    created = create(client, input="Hi", store=False)
    assert created["store"] is False
    assert created["status"] == "completed"

    fetched = client.get(f"/v1/responses/{created['id']}")
    assert fetched.status_code == 404
    assert fetched.json()["error"]["param"] == "response_id"
    assert client.get(f"/v1/responses/{created['id']}/input_items").status_code == 404

    follow_up = client.post(
        "/v1/responses",
        json={"model": "demo", "input": "Again", "previous_response_id": created["id"]},
    )
    assert follow_up.status_code == 404
    assert follow_up.json()["error"]["param"] == "previous_response_id"


def test_unstored_response_output_items_cannot_be_referenced(client: TestClient) -> None:
    created = create(client, input="Hi", store=False)
    message_id = created["output"][-1]["id"]
    response = client.post(
        "/v1/responses",
        json={"model": "demo", "input": [{"type": "item_reference", "id": message_id}]},
    )
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "input[0].id"


# -- (c) previous_response_id ----------------------------------------------------------------


def test_previous_response_continues_input_and_output_not_instructions(
    client: TestClient, engine: ScriptedEngine
) -> None:
    first = create(
        client, input="What is the capital of Norway?", instructions="Talk like a pirate."
    )
    assert first["output"][-1]["content"][0]["text"] == "Hello!"
    assert "Talk like a pirate." in decode(engine.prompts[-1])

    second = create(client, input="And of Sweden?", previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    assert second["instructions"] is None
    prompt = decode(engine.prompts[-1])
    assert "What is the capital of Norway?" in prompt
    assert "Hello!" in prompt
    assert "And of Sweden?" in prompt
    assert "Talk like a pirate." not in prompt
    # The order of the conversation: first question, first answer, new question.
    positions = [prompt.index(text) for text in ("Norway", "Hello!", "Sweden")]
    assert positions == sorted(positions)
    # The earlier turn ended in a final answer, so its analysis is dropped.
    assert "Thinking." not in prompt
    # Only the new input is listed as this response's input items.
    items = client.get(f"/v1/responses/{second['id']}/input_items").json()["data"]
    assert [item["content"][0]["text"] for item in items] == ["And of Sweden?"]


def test_previous_response_chain_of_three(client: TestClient, engine: ScriptedEngine) -> None:
    first = create(client, input="one")
    second = create(client, input="two", previous_response_id=first["id"])
    create(client, input="three", previous_response_id=second["id"], instructions="New rules.")
    prompt = decode(engine.prompts[-1])
    positions = [prompt.index(f"<|message|>{word}<|end|>") for word in ("one", "two", "three")]
    assert positions == sorted(positions)
    assert prompt.count("Hello!") == 2
    assert "New rules." in prompt


def test_item_reference_to_a_stored_output_item(client: TestClient, engine: ScriptedEngine) -> None:
    first = create(client, input="Hi")
    message_id = first["output"][-1]["id"]
    create(
        client,
        input=[
            {"type": "item_reference", "id": message_id},
            {"role": "user", "content": "Say it again."},
        ],
    )
    prompt = decode(engine.prompts[-1])
    assert "<|channel|>final<|message|>Hello!" in prompt
    assert "Say it again." in prompt


# -- (d) input_items pagination --------------------------------------------------------------


@pytest.fixture()
def five_items(client: TestClient) -> tuple[str, list[str]]:
    """A response with five user messages m0..m4; returns its id and the item ids in order."""
    created = create(client, input=[{"role": "user", "content": f"m{i}"} for i in range(5)])
    listing = client.get(f"/v1/responses/{created['id']}/input_items?order=asc&limit=100")
    ids = [item["id"] for item in listing.json()["data"]]
    assert len(ids) == 5
    assert len(set(ids)) == 5
    return created["id"], ids


def page(client: TestClient, response_id: str, query: str = "") -> dict[str, Any]:
    response = client.get(f"/v1/responses/{response_id}/input_items?{query}")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    return body


def texts(body: dict[str, Any]) -> list[str]:
    return [item["content"][0]["text"] for item in body["data"]]


def test_input_items_default_order_is_newest_first(
    client: TestClient, five_items: tuple[str, list[str]]
) -> None:
    response_id, ids = five_items
    body = page(client, response_id)
    assert texts(body) == ["m4", "m3", "m2", "m1", "m0"]
    assert body["first_id"] == ids[4]
    assert body["last_id"] == ids[0]
    assert body["has_more"] is False
    for item in body["data"]:
        assert item["type"] == "message"
        assert item["role"] == "user"
        assert item["status"] == "completed"
        assert item["id"].startswith("msg_")


def test_input_items_pages_ascending(client: TestClient, five_items: tuple[str, list[str]]) -> None:
    response_id, ids = five_items
    first = page(client, response_id, "order=asc&limit=2")
    assert texts(first) == ["m0", "m1"]
    assert (first["first_id"], first["last_id"], first["has_more"]) == (ids[0], ids[1], True)

    second = page(client, response_id, f"order=asc&limit=2&after={first['last_id']}")
    assert texts(second) == ["m2", "m3"]
    assert (second["first_id"], second["last_id"], second["has_more"]) == (ids[2], ids[3], True)

    third = page(client, response_id, f"order=asc&limit=2&after={second['last_id']}")
    assert texts(third) == ["m4"]
    assert (third["first_id"], third["last_id"], third["has_more"]) == (ids[4], ids[4], False)


def test_input_items_pages_descending(
    client: TestClient, five_items: tuple[str, list[str]]
) -> None:
    response_id, ids = five_items
    first = page(client, response_id, "order=desc&limit=3")
    assert texts(first) == ["m4", "m3", "m2"]
    assert (first["first_id"], first["last_id"], first["has_more"]) == (ids[4], ids[2], True)

    rest = page(client, response_id, f"order=desc&limit=3&after={first['last_id']}")
    assert texts(rest) == ["m1", "m0"]
    assert (rest["first_id"], rest["last_id"], rest["has_more"]) == (ids[1], ids[0], False)


def test_input_items_page_edges(client: TestClient, five_items: tuple[str, list[str]]) -> None:
    response_id, ids = five_items
    exact = page(client, response_id, "order=asc&limit=5")
    assert texts(exact) == ["m0", "m1", "m2", "m3", "m4"]
    assert exact["has_more"] is False

    after_last = page(client, response_id, f"order=asc&after={ids[4]}")
    assert after_last["data"] == []
    assert (after_last["first_id"], after_last["last_id"], after_last["has_more"]) == (
        None,
        None,
        False,
    )


def test_input_items_keep_client_ids_and_all_item_kinds(client: TestClient) -> None:
    first = create(client, input="Weather?", tools=[WEATHER_TOOL])
    created = create(
        client,
        tools=[WEATHER_TOOL],
        input=[
            {"id": "msg_client1", "role": "user", "content": "Weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": "call_abc",
                "name": "get_weather",
                "arguments": '{"city":"Oslo"}',
            },
            {"type": "function_call_output", "call_id": "call_abc", "output": "sunny"},
        ],
        previous_response_id=first["id"],
    )
    data = page(client, created["id"], "order=asc")["data"]
    assert [item["type"] for item in data] == ["message", "function_call", "function_call_output"]
    assert data[0]["id"] == "msg_client1"
    assert data[1]["id"].startswith("fc_")
    assert data[1]["call_id"] == data[2]["call_id"] == "call_abc"
    assert data[2]["output"] == "sunny"


# -- (e) function calls across responses -----------------------------------------------------


def test_function_call_output_continues_a_stored_call(
    client: TestClient, engine: ScriptedEngine
) -> None:
    engine.scripts.appendleft(harmony_tokens(WEATHER_CALL))  # the call, then the final answer
    first = create(client, input="What is the weather in Oslo?", tools=[WEATHER_TOOL])
    call = first["output"][-1]
    assert call["type"] == "function_call"
    assert call["name"] == "get_weather"
    assert call["arguments"] == '{"city":"Oslo"}'
    assert call["call_id"].startswith("call_")

    second = create(
        client,
        tools=[WEATHER_TOOL],
        previous_response_id=first["id"],
        input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}],
    )
    assert second["status"] == "completed"
    prompt = decode(engine.prompts[-1])
    assert "What is the weather in Oslo?" in prompt
    # The call replays as the commentary message to functions.get_weather the model generated
    # (harmony/replay.py: the recipient after the channel), its output as a message from that
    # tool; in that order, after the question.
    call_text = '<|constrain|>json<|message|>{"city":"Oslo"}<|call|>'
    output_text = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny"
    assert "<|start|>assistant<|channel|>commentary to=functions.get_weather " + call_text in prompt
    assert prompt.index("Oslo?") < prompt.index(call_text) < prompt.index(output_text)


def test_function_call_output_with_unknown_call_id(
    client: TestClient, engine: ScriptedEngine
) -> None:
    engine.scripts.appendleft(harmony_tokens(WEATHER_CALL))
    first = create(client, input="What is the weather in Oslo?", tools=[WEATHER_TOOL])
    response = client.post(
        "/v1/responses",
        json={
            "model": "demo",
            "tools": [WEATHER_TOOL],
            "previous_response_id": first["id"],
            "input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}],
        },
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "input[0].call_id"
    # Without the previous response, even the real call_id is unknown.
    real_call_id = first["output"][-1]["call_id"]
    response = client.post(
        "/v1/responses",
        json={
            "model": "demo",
            "tools": [WEATHER_TOOL],
            "input": [{"type": "function_call_output", "call_id": real_call_id, "output": "x"}],
        },
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input[0].call_id"


# -- (f) ResponseStore directly --------------------------------------------------------------


def stored_response(response_id: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "created_at": 1700000000, "output": output}


def message(item_id: str, text: str, kind: str = "input_text") -> dict[str, Any]:
    content = [{"type": kind, "text": text}]
    return {"id": item_id, "type": "message", "role": "user", "content": content}


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ResponseStore]:
    path = ":memory:" if request.param == "memory" else tmp_path / "nested" / "store.sqlite"
    response_store = ResponseStore(path)
    yield response_store
    response_store.close()


def test_store_round_trip(store: ResponseStore) -> None:
    output = [message("msg_out", "Hello!", "output_text")]
    response = stored_response("resp_1", output)
    inputs = [message("msg_in", "Hi")]
    conversation = [{"kind": "message", "role": "user", "content": "Hi", "channel": None}]
    store.put(response, inputs, conversation)

    assert store.get("resp_1") == response
    assert store.input_items("resp_1") == inputs
    assert store.conversation("resp_1") == conversation
    assert store.item("msg_in") == inputs[0]
    assert store.item("msg_out") == output[0]

    assert store.get("resp_2") is None
    assert store.input_items("resp_2") is None
    assert store.conversation("resp_2") is None
    assert store.item("msg_nope") is None


def test_store_put_replaces(store: ResponseStore) -> None:
    store.put(stored_response("resp_1", []), [], [])
    updated = {**stored_response("resp_1", []), "status": "completed"}
    store.put(updated, [message("msg_in", "Hi")], [])
    assert store.get("resp_1") == updated
    assert store.input_items("resp_1") == [message("msg_in", "Hi")]


def test_store_delete_removes_the_response_and_its_items(store: ResponseStore) -> None:
    output = [message("msg_out", "a", "output_text")]
    store.put(stored_response("resp_1", output), [message("msg_in", "b")], [])
    store.put(stored_response("resp_2", []), [message("msg_other", "c")], [])

    assert store.delete("resp_1") is True
    assert store.get("resp_1") is None
    assert store.input_items("resp_1") is None
    assert store.item("msg_in") is None
    assert store.item("msg_out") is None
    assert store.delete("resp_1") is False
    assert store.delete("resp_nope") is False
    # Other responses are untouched.
    assert store.get("resp_2") is not None
    assert store.item("msg_other") == message("msg_other", "c")


def test_store_file_persists_across_instances(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite"
    first = ResponseStore(path)
    first.put(stored_response("resp_1", []), [message("msg_in", "Hi")], [{"kind": "x"}])
    first.close()
    second = ResponseStore(path)
    try:
        assert second.get("resp_1") == stored_response("resp_1", [])
        assert second.item("msg_in") == message("msg_in", "Hi")
        assert second.conversation("resp_1") == [{"kind": "x"}]
    finally:
        second.close()


def test_deleting_a_referencing_response_keeps_the_original_item(store: ResponseStore) -> None:
    original = message("msg_out", "Hello!", "output_text")
    store.put(stored_response("resp_1", [original]), [], [])
    # resp_2 used msg_out through an item_reference, so it is one of resp_2's input items.
    store.put(stored_response("resp_2", []), [original], [])
    assert store.delete("resp_2") is True
    assert store.item("msg_out") == original


def test_item_reference_survives_deleting_a_later_response(client: TestClient) -> None:
    first = create(client, input="Hi")
    message_id = first["output"][-1]["id"]
    second = create(client, input=[{"type": "item_reference", "id": message_id}])
    assert client.delete(f"/v1/responses/{second['id']}").status_code == 200
    assert client.get(f"/v1/responses/{first['id']}").status_code == 200
    third = client.post(
        "/v1/responses",
        json={"model": "demo", "input": [{"type": "item_reference", "id": message_id}]},
    )
    assert third.status_code == 200, third.text


def test_item_reference_to_a_deleted_response_is_404(client: TestClient) -> None:
    first = create(client, input="Hi")
    message_id = first["output"][-1]["id"]
    assert client.delete(f"/v1/responses/{first['id']}").status_code == 200
    response = client.post(
        "/v1/responses",
        json={"model": "demo", "input": [{"type": "item_reference", "id": message_id}]},
    )
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "input[0].id"
