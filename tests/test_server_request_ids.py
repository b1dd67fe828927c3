"""`x-request-id` on every answer (successes, refusals, preflights, streams, 500s), fresh per
request, and what the SDK reports as `_request_id` / `request_id`."""

from __future__ import annotations

import logging
import re

import openai
import pytest
from fastapi.testclient import TestClient

from gptoss_serve.config import ServerConfig
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import REASONING_THEN_FINAL, ScriptedEngine, harmony_tokens, running_server

REQUEST_ID = re.compile(r"^req_[0-9a-f]{32}$")
BODY = {"model": "demo", "input": "Hi", "max_output_tokens": 64}


def _engine() -> ScriptedEngine:
    engine = ScriptedEngine()
    engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    return engine


def test_every_answer_has_a_fresh_request_id() -> None:
    config = ServerConfig(max_request_bytes=1024, allowed_origins=("https://app.example.com",))
    with TestClient(create_app(_engine(), ResponseStore(":memory:"), config)) as client:
        answers = [
            client.post("/v1/responses", json=BODY),
            client.post("/v1/responses", json={**BODY, "temperature": 9}),
            client.post("/v1/responses", json={**BODY, "input": "x" * 2048}),
            client.get("/v1/responses/resp_missing"),
            client.get("/v1/models"),
            client.get("/health"),
            client.get("/metrics"),
            client.put("/v1/responses"),
            client.options("/v1/responses", headers={
                "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST"}),
        ]  # fmt: skip
        statuses = [answer.status_code for answer in answers]
        assert statuses == [200, 400, 413, 404, 200, 200, 200, 405, 200]
        ids = [answer.headers["x-request-id"] for answer in answers]
        assert all(REQUEST_ID.match(request_id) for request_id in ids)
        assert len(set(ids)) == len(ids)
        preflight = answers[-1]
        assert "x-request-id" in preflight.headers
        cross = client.get("/v1/models", headers={"Origin": "https://app.example.com"})
        assert "x-request-id" in cross.headers["access-control-expose-headers"].lower()


def test_a_401_and_a_stream_have_one() -> None:
    config = ServerConfig(api_keys=("sk-request-ids",))
    with TestClient(create_app(_engine(), ResponseStore(":memory:"), config)) as client:
        refused = client.post("/v1/responses", json=BODY)
        assert refused.status_code == 401 and REQUEST_ID.match(refused.headers["x-request-id"])
        headers = {"Authorization": "Bearer sk-request-ids"}
        with client.stream("POST", "/v1/responses", json={**BODY, "stream": True},
                           headers=headers) as stream:  # fmt: skip
            assert REQUEST_ID.match(stream.headers["x-request-id"])
            assert any(line.startswith("data: ") for line in stream.iter_lines())


def test_a_500_has_one_and_is_logged_with_it(caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(_engine(), ResponseStore(":memory:"), ServerConfig())

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as client, caplog.at_level(logging.ERROR):
        answer = client.get("/v1/boom")
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "server_error"
    request_id = answer.headers["x-request-id"]
    assert REQUEST_ID.match(request_id)
    assert any(request_id in record.getMessage() for record in caplog.records)


def test_the_sdk_reports_them() -> None:
    app = create_app(_engine(), ResponseStore(":memory:"), ServerConfig())
    with running_server(app) as base_url:
        sdk = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        response = sdk.responses.create(**BODY)
        assert REQUEST_ID.match(response._request_id or "")
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.responses.create(**{**BODY, "temperature": 9})
        assert REQUEST_ID.match(caught.value.request_id or "")
        assert caught.value.request_id != response._request_id
