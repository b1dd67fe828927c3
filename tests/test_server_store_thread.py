"""A finished response is stored off the event loop (its JSON and SQLite's commit would stall
every other stream), and before its terminal event reaches the client; a stored conversation
that a follow-up continues is read off it too."""

from __future__ import annotations

import asyncio

from fastapi.testclient import TestClient

from gptoss_serve.config import ServerConfig
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import REASONING_THEN_FINAL, ScriptedEngine, harmony_tokens


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class _RecordingStore(ResponseStore):
    def __init__(self) -> None:
        super().__init__(":memory:")
        self.puts_on_loop: list[bool] = []
        self.reads_on_loop: list[bool] = []

    def put(self, response, input_items, conversation, parent=None) -> None:
        self.puts_on_loop.append(_on_event_loop())
        super().put(response, input_items, conversation, parent)

    def conversation(self, response_id):
        self.reads_on_loop.append(_on_event_loop())
        return super().conversation(response_id)


BODY = {"model": "demo", "input": "Hi", "max_output_tokens": 64}


def _client(store: ResponseStore) -> TestClient:
    """The app over ``store``, its engine answering every request with the same script."""
    engine = ScriptedEngine([harmony_tokens(REASONING_THEN_FINAL)])
    return TestClient(create_app(engine, store, ServerConfig()))


def test_responses_are_stored_off_the_loop_before_the_terminal_event() -> None:
    store = _RecordingStore()
    with _client(store) as client:
        created = client.post("/v1/responses", json=BODY).json()
        assert client.get(f"/v1/responses/{created['id']}").status_code == 200
        with client.stream("POST", "/v1/responses", json={**BODY, "stream": True}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: ") and '"response.completed"' in line:
                    response_id = line.split('"id":"', 1)[1].split('"', 1)[0]
                    # the terminal event has arrived: the response is stored already
                    assert store.get(response_id) is not None
                    break
    assert store.puts_on_loop == [False, False]


def test_a_follow_up_reads_the_stored_conversation_off_the_loop() -> None:
    store = _RecordingStore()
    with _client(store) as client:
        first = client.post("/v1/responses", json=BODY).json()["id"]
        follow = {**BODY, "previous_response_id": first}
        assert client.post("/v1/responses", json=follow).status_code == 200
        counted = client.post("/v1/responses/input_tokens", json={"input": "Hi",
                              "previous_response_id": first})  # fmt: skip
        assert counted.status_code == 200
    assert store.reads_on_loop and not any(store.reads_on_loop)
