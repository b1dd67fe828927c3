"""``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: each output_text part
carries its tokens' log-probabilities, and each text delta those of its own tokens.

A scripted engine gives exact made-up values (server_helpers.scripted_logprobs); the last
test takes the demo model's through the SDK.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response

from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.cpu_engine import CpuEngine
from gptoss_serve.harmony import adapter
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
from test_server_stream import _stream

INCLUDE = ["message.output_text.logprobs"]


def _expected(script: str, content: str, k: int) -> list[dict[str, Any]]:
    """The scripted engine's entries for the tokens of ``content`` inside ``script``."""
    tokens = harmony_tokens(script)
    content_tokens = adapter.encode(content)
    start = next(
        i for i in range(len(tokens)) if tokens[i : i + len(content_tokens)] == content_tokens
    )
    entries = []
    for position in range(start, start + len(content_tokens)):
        token, logprob = tokens[position], -(position + 1) / 100
        entries.append({
            **_token(token, logprob),
            "top_logprobs": [_token(token + j, logprob - j) for j in range(k)],
        })  # fmt: skip
    return entries


def _token(token_id: int, logprob: float) -> dict[str, Any]:
    raw = adapter.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw), "logprob": logprob}


def _without_bytes(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def short(entry: dict[str, Any]) -> dict[str, Any]:
        return {"token": entry["token"], "logprob": entry["logprob"]}

    return [{**short(e), "top_logprobs": [short(t) for t in e["top_logprobs"]]} for e in entries]


def test_the_answer_carries_its_tokens_logprobs(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    scripted_engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    body = {"model": "demo", "input": "Hi", "include": INCLUDE, "top_logprobs": 3}
    response = scripted_client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    data = Response.model_validate(response.json()).model_dump(mode="json")
    assert scripted_engine.params[-1].logprobs == 3
    reasoning, message = data["output"]
    assert reasoning["type"] == "reasoning" and message["type"] == "message"
    part = message["content"][0]
    text = "Hello there, friend! 👋"
    assert part["text"] == text
    assert part["logprobs"] == _expected(REASONING_THEN_FINAL, text, 3)
    # The tokens' bytes spell the text exactly, though the emoji's are split across tokens.
    assert bytes(b for entry in part["logprobs"] for b in entry["bytes"]).decode() == text
    assert data["top_logprobs"] == 3


def test_deltas_carry_the_logprobs_of_their_own_tokens(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    scripted_engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    events, final = _stream(scripted_client, include=INCLUDE, top_logprobs=2)
    expected = _expected(REASONING_THEN_FINAL, "Hello there, friend! 👋", 2)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [entry for d in deltas for entry in d["logprobs"]] == _without_bytes(expected)
    # A delta's text is its tokens' text (a token ending inside a UTF-8 sequence waits for
    # the one that completes it: the delta has both).
    for delta in deltas:
        assert delta["logprobs"], delta
        raw = b"".join(adapter.token_bytes(adapter.encode(e["token"])[0]) for e in delta["logprobs"]
                       if "\ufffd" not in e["token"])  # fmt: skip
        assert raw.decode() in delta["delta"]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == _without_bytes(expected)
    assert final["output"][1]["content"][0]["logprobs"] == expected
    for event in events:  # reasoning deltas have no logprobs field at all
        if event["type"] == "response.reasoning_text.delta":
            assert "logprobs" not in event


def test_a_preamble_has_logprobs_and_a_function_call_none(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    scripted_engine.queue(harmony_tokens(PREAMBLE_AND_CALL))
    body = {"model": "demo", "input": "Weather?", "tools": TOOLS, "include": INCLUDE}
    data = scripted_client.post("/v1/responses", json=body).json()
    kinds = [item["type"] for item in data["output"]]
    assert kinds == ["reasoning", "message", "function_call"]
    assert data["output"][1]["content"][0]["logprobs"] == _expected(PREAMBLE_AND_CALL,
                                                                    "Let me check.", 0)  # fmt: skip


def test_without_the_include_there_are_none(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    scripted_engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    body = {"model": "demo", "input": "Hi", "top_logprobs": 5}
    data = scripted_client.post("/v1/responses", json=body).json()
    assert scripted_engine.params[-1].logprobs is None
    assert data["output"][1]["content"][0]["logprobs"] == []
    scripted_engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    events, _ = _stream(scripted_client)
    assert all(e["logprobs"] == [] for e in events if e["type"] == "response.output_text.delta")


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"top_logprobs": 21}, "top_logprobs", "integer_above_max_value"),
        ({"top_logprobs": -1}, "top_logprobs", "integer_below_min_value"),
        ({"include": [*INCLUDE, "file_search_call.results"]}, "include[1]",
         "unsupported_parameter"),
    ],
)  # fmt: skip
def test_bad_values_are_refused(
    scripted_client: TestClient, body: dict, param: str, code: str
) -> None:
    response = scripted_client.post("/v1/responses", json={"model": "demo", "input": "Hi", **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)


@pytest.fixture(scope="module")
def demo_client(
    demo_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    engine = CpuEngine(load_model(demo_dir), "demo")
    store = ResponseStore(tmp_path_factory.mktemp("store") / "responses.sqlite3")
    with running_server(create_app(engine, store, ServerConfig())) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_the_demo_models_logprobs_through_the_sdk(demo_client: openai.OpenAI, stream: bool) -> None:
    # No reasoning: the answer starts at once, so 24 tokens hold some of its text.
    options = dict(model="demo", input="Hi", max_output_tokens=24, include=INCLUDE, top_logprobs=4,
                   temperature=0, extra_body={"reasoning_budget": 0})  # fmt: skip
    if stream:  # (the SDK's stream helper wants response.completed; this may be incomplete)
        events = list(demo_client.responses.create(**options, stream=True))
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        response = events[-1].response
    else:
        response = demo_client.responses.create(**options)
    response = Response.model_validate(response.model_dump(mode="json"))
    (message,) = [item for item in response.output if item.type == "message"]
    part = message.content[0]
    assert part.logprobs, "the answer has tokens"
    most_likely = 0
    for entry in part.logprobs:
        assert len(entry.top_logprobs) == 4
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry.logprob <= values[0]
        most_likely += entry.token == entry.top_logprobs[0].token
    # Greedy: the token drawn is the most likely one, but where the grammar (valid UTF-8
    # after a token that ends inside a character) rules that one out: the log-probabilities
    # are the model's, before the grammar's mask.
    assert most_likely >= len(part.logprobs) / 2
    joined = bytes(b for entry in part.logprobs for b in entry.bytes)
    assert part.text.encode() in (joined, joined.decode(errors="ignore").encode())
    if stream:  # the deltas' entries, then those of a character the end cut off
        streamed = [(e.token, e.logprob) for d in deltas for e in d.logprobs]
        assert streamed == [(e.token, e.logprob) for e in part.logprobs][: len(streamed)]
        assert len(streamed) >= len(part.logprobs) - 3


def test_a_background_response_keeps_its_logprobs(scripted_engine: ScriptedEngine) -> None:
    """Stored, replayed from its events and continued: the entries survive each."""
    scripted_engine.queue(
        harmony_tokens(REASONING_THEN_FINAL), harmony_tokens(REASONING_THEN_FINAL)
    )
    app = create_app(scripted_engine, ResponseStore(":memory:"), ServerConfig())
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        created = client.responses.create(model="demo", input="Hi", background=True,
                                          include=INCLUDE, top_logprobs=1)  # fmt: skip
        for _ in range(500):
            done = client.responses.retrieve(created.id)
            if done.status == "completed":
                break
            time.sleep(0.01)
        replay = list(client.responses.retrieve(created.id, stream=True))
        follow_up = client.responses.create(model="demo", input="More", include=INCLUDE,
                                            previous_response_id=created.id)  # fmt: skip
    expected = _expected(REASONING_THEN_FINAL, "Hello there, friend! 👋", 1)
    assert done.model_dump(mode="json")["output"][1]["content"][0]["logprobs"] == expected
    deltas = [e for e in replay if e.type == "response.output_text.delta"]
    assert [entry.token for d in deltas for entry in d.logprobs] == [e["token"] for e in expected]
    assert follow_up.output[1].content[0].logprobs  # the continued turn has its own
