"""The real `openai` SDK against a real server on loopback serving the demo model.

The demo's weights are random, so its text is noise (and may never leave a header); these
tests check shapes, order and state, which must hold whatever the model writes.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.responses import Response

from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.cpu_engine import CpuEngine
from gptoss_serve.model import load_model
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import (
    PREAMBLE_AND_CALL,
    REASONING_THEN_FINAL,
    TOOLS,
    ScriptedEngine,
    harmony_tokens,
    running_server,
)


@pytest.fixture(scope="module")
def client(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    engine = CpuEngine(load_model(demo_dir), "demo")
    store = ResponseStore(tmp_path_factory.mktemp("store") / "responses.sqlite3")
    app = create_app(engine, store, ServerConfig())
    with running_server(app) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def scripted() -> Iterator[tuple[openai.OpenAI, ScriptedEngine]]:
    """A real server whose engine replays scripted Harmony output (exact items)."""
    engine = ScriptedEngine()
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig())
    with running_server(app) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0), engine


def _valid(response: Response) -> Response:
    # The SDK builds its objects without validation; validate the data strictly.
    return Response.model_validate(response.model_dump(mode="json"))


def test_plain_input(client: openai.OpenAI) -> None:
    response = _valid(client.responses.create(model="demo", input="Hello!", max_output_tokens=16))
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.usage.output_tokens <= 16
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_instructions_tools_and_a_tool_call_history(client: openai.OpenAI) -> None:
    response = _valid(
        client.responses.create(
            model="demo",
            instructions="Answer briefly.",
            tools=TOOLS,
            input=[
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 3}'},
            ],
            max_output_tokens=16,
            temperature=0.7,
            top_p=0.9,
            metadata={"suite": "sdk"},
        )
    )
    assert response.instructions == "Answer briefly."
    assert response.tools[0].name == "get_weather"
    assert response.metadata == {"suite": "sdk"} and response.temperature == 0.7
    items = client.responses.input_items.list(response.id, order="asc").data
    assert [item.type for item in items] == ["message", "function_call", "function_call_output"]


def test_previous_response_id_retrieve_and_delete(client: openai.OpenAI) -> None:
    first = client.responses.create(model="demo", input="One.", max_output_tokens=16)
    second = client.responses.create(
        model="demo", input="Two.", previous_response_id=first.id, max_output_tokens=16
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens  # the history came along
    fetched = client.responses.retrieve(second.id)
    assert fetched.model_dump() == second.model_dump()
    deleted = client.responses.delete(second.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(second.id)
    assert info.value.body["code"] == "not_found"


@pytest.mark.parametrize("script", [REASONING_THEN_FINAL, PREAMBLE_AND_CALL])
def test_stream_accumulates_to_the_same_items(
    scripted: tuple[openai.OpenAI, ScriptedEngine], script: str
) -> None:
    client, engine = scripted
    engine.queue(harmony_tokens(script), harmony_tokens(script))
    done_items = []
    with client.responses.stream(model="demo", input="Weather?", tools=TOOLS) as stream:
        for event in stream:
            if event.type == "response.output_item.done":
                done_items.append(event.item.model_dump(exclude_none=True))
        final = _valid(stream.get_final_response())
    assert final.status == "completed" and len(done_items) >= 2
    # (the accumulator adds `parsed: None` to text parts; None fields are left out here)
    assert [item.model_dump(exclude_none=True) for item in final.output] == done_items
    stored = client.responses.retrieve(final.id).output
    assert [item.model_dump(exclude_none=True) for item in stored] == done_items
    plain = _valid(client.responses.create(model="demo", input="Weather?", tools=TOOLS))
    assert [_without_ids(item.model_dump(exclude_none=True)) for item in plain.output] == [
        _without_ids(item) for item in done_items
    ]


def _without_ids(item: dict) -> dict:
    return {key: value for key, value in item.items() if key not in ("id", "call_id")}


def test_stream_of_the_demo_model(client: openai.OpenAI) -> None:
    event_types = []
    stream = client.responses.create(
        model="demo", input="Stream please.", max_output_tokens=24, stream=True,
        stream_options={"include_obfuscation": False},  # accepted (no obfuscation is sent)
    )  # fmt: skip
    for event in stream:
        event_types.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = _valid(event.response)
    assert event_types[:2] == ["response.created", "response.in_progress"]
    assert event_types[-1] in ("response.completed", "response.incomplete")
    assert client.responses.retrieve(final.id).output == final.output


def test_concurrent_requests_all_finish(client: openai.OpenAI) -> None:
    def one(index: int) -> Response:
        return client.responses.create(model="demo", input=f"Request {index}", max_output_tokens=16)

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        responses = list(pool.map(one, range(3)))
    assert len({r.id for r in responses}) == 3
    assert all(r.usage.output_tokens == 16 or r.status == "completed" for r in responses)


def test_models_and_errors(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="demo", input="x", temperature=5)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="x")
