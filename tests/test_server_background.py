"""Background responses: answered at once, polled, streamed again from any event, cancelled.

Against a real uvicorn server (the generation must outlive the request that started it), with
the official SDK where it has the call and raw HTTP for the rest.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gptoss_serve.config import ServerConfig
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import ScriptedEngine, harmony_tokens, running_server

REPLY = (
    "<|channel|>analysis<|message|>Thinking it over.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>"
)
LONG = "<|channel|>analysis<|message|>" + "word " * 400  # ~4 s at 10 ms a token


@contextlib.contextmanager
def _serving(script: str, delay: float) -> Iterator[tuple[str, openai.OpenAI, ScriptedEngine]]:
    """A uvicorn server over an engine that replays ``script``, ``delay`` s a token."""
    engine = ScriptedEngine([harmony_tokens(script)])
    engine.delay = delay
    with running_server(create_app(engine, ResponseStore(":memory:"), ServerConfig())) as url:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none"), engine


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


def _until(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_a_background_response_is_queued_then_polled_to_its_end() -> None:
    with _serving(REPLY, 0.005) as (_, client, _engine):
        created = client.responses.create(model="demo", input="Hi", background=True)
        assert created.status == "queued" and created.background
        _until(lambda: client.responses.retrieve(created.id).status == "completed")
        done = client.responses.retrieve(created.id)
        plain = client.responses.create(model="demo", input="Hi")
    assert done.background and done.output_text == "Hello there!"
    assert _without_ids([i.model_dump() for i in done.output]) == _without_ids(
        [i.model_dump() for i in plain.output]
    )
    assert done.usage is not None and done.usage.output_tokens == plain.usage.output_tokens


def test_a_background_stream_is_taken_up_again_after_the_connection_drops() -> None:
    script = LONG[:200] + "<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    payload = {"model": "demo", "input": "Hi", "stream": True, "background": True}
    with _serving(script, 0.005) as (url, _, engine):
        first = []
        with httpx.stream("POST", f"{url}/v1/responses", json=payload) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    first.append(json.loads(line[5:]))
                if len(first) == 6:
                    break  # the client goes away; the generation does not
        response_id = first[0]["response"]["id"]
        resumed_at = first[-1]["sequence_number"]
        with httpx.stream(
            "GET",
            f"{url}/v1/responses/{response_id}",
            params={"stream": "true", "starting_after": resumed_at},
        ) as response:
            rest = _events(response)
        with httpx.stream(
            "GET", f"{url}/v1/responses/{response_id}", params={"stream": "true"}
        ) as response:
            replay = _events(response)
        stored = httpx.get(f"{url}/v1/responses/{response_id}").json()
    assert engine.aborted == []
    numbers = [event["sequence_number"] for event in first + rest]
    assert numbers == list(range(len(numbers)))
    assert replay == first + rest
    assert rest[-1]["type"] == "response.completed"
    assert rest[-1]["response"] == stored and stored["status"] == "completed"
    with _serving(script, 0.0) as (url, _, _engine):
        done = httpx.post(f"{url}/v1/responses", json={**payload, "stream": False}).json()
        path = f"{url}/v1/responses/{done['id']}"
        _until(lambda: httpx.get(path).json()["status"] == "completed")
        caught_up = httpx.get(path, params={"stream": "true", "starting_after": len(numbers) - 1})
        past = httpx.get(path, params={"stream": "true", "starting_after": len(numbers)})
    assert caught_up.status_code == 200 and caught_up.text == ""  # nothing after the last
    assert past.status_code == 400 and past.json()["error"]["param"] == "starting_after"


def test_cancel_stops_a_background_response() -> None:
    with _serving(LONG, 0.01) as (url, client, engine):
        created = client.responses.create(model="demo", input="Hi", background=True)
        _until(lambda: bool(engine.prompts))
        time.sleep(0.1)
        cancelled = client.responses.cancel(created.id)
        again = client.responses.cancel(created.id)  # idempotent
        stored = client.responses.retrieve(created.id)
        with httpx.stream(
            "GET", f"{url}/v1/responses/{created.id}", params={"stream": "true"}
        ) as response:
            replay = _events(response)
        metrics = httpx.get(f"{url}/metrics").text
    assert 'gptoss_requests_total{status="cancelled"} 1.0' in metrics
    assert cancelled.status == again.status == stored.status == "cancelled"
    assert engine.aborted == [created.id]
    assert stored.output and stored.output[0].status == "incomplete"  # cut off mid-way
    assert replay[-1]["type"] == "response.output_item.done"  # no terminal event after cancel


def test_continuing_a_running_background_response_is_a_400_until_it_ends() -> None:
    with _serving(REPLY, 0.05) as (url, client, _engine):
        created = client.responses.create(model="demo", input="Hi", background=True)
        early = httpx.post(f"{url}/v1/responses", json={
            "model": "demo", "input": "And then?", "previous_response_id": created.id})  # fmt: skip
        _until(lambda: client.responses.retrieve(created.id).status == "completed")
        later = client.responses.create(model="demo", input="And then?",
                                        previous_response_id=created.id)  # fmt: skip
    assert early.status_code == 400, early.text
    assert early.json()["error"]["param"] == "previous_response_id"
    assert later.status == "completed"


@pytest.mark.parametrize(
    ("method", "path", "params", "status", "param"),
    [
        ("POST", "/v1/responses/{id}/cancel", {}, 400, "response_id"),
        ("POST", "/v1/responses/resp_nope/cancel", {}, 404, "response_id"),
        ("GET", "/v1/responses/{id}", {"stream": "true"}, 400, "stream"),
        ("GET", "/v1/responses/resp_nope", {"stream": "true"}, 404, "response_id"),
        ("GET", "/v1/responses/{id}", {"stream": "true", "starting_after": "x"}, 400,
         "starting_after"),
    ],
)  # fmt: skip
def test_background_only_calls_refuse_other_responses(
    method: str, path: str, params: dict, status: int, param: str
) -> None:
    with _serving(REPLY, 0.0) as (url, _, _engine):
        plain = httpx.post(f"{url}/v1/responses", json={"model": "demo", "input": "Hi"}).json()
        response = httpx.request(method, url + path.format(id=plain["id"]), params=params)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_deleting_a_background_response_stops_it_and_forgets_its_events() -> None:
    with _serving(LONG, 0.01) as (url, client, engine):
        running = client.responses.create(model="demo", input="Hi", background=True)
        _until(lambda: bool(engine.prompts))
        deleted = httpx.delete(f"{url}/v1/responses/{running.id}")
        time.sleep(0.2)  # a run left going would store the object again as it ends
        after = [
            httpx.get(f"{url}/v1/responses/{running.id}"),
            httpx.get(f"{url}/v1/responses/{running.id}", params={"stream": "true"}),
            httpx.post(f"{url}/v1/responses/{running.id}/cancel"),
            httpx.delete(f"{url}/v1/responses/{running.id}"),
        ]
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": running.id, "object": "response", "deleted": True}
    assert engine.aborted == [running.id]  # the generation stopped
    for response in after:
        assert response.status_code == 404, response.text
        assert response.json()["error"]["param"] == "response_id"


def test_deleting_an_ended_background_response_forgets_its_events() -> None:
    with _serving(REPLY, 0.0) as (url, client, _engine):
        created = client.responses.create(model="demo", input="Hi", background=True)
        _until(lambda: client.responses.retrieve(created.id).status == "completed")
        assert httpx.delete(f"{url}/v1/responses/{created.id}").status_code == 200
        replay = httpx.get(f"{url}/v1/responses/{created.id}", params={"stream": "true"})
        cancel = httpx.post(f"{url}/v1/responses/{created.id}/cancel")
    assert replay.status_code == cancel.status_code == 404
