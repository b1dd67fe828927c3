"""API keys: /v1 routes need `Authorization: Bearer KEY` when the server has keys; the
liveness checks and the metrics stay open; a 401 has the OpenAI error shape."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
from fastapi.testclient import TestClient

from gptoss_serve import cli
from gptoss_serve.benchmarks import serve_load
from gptoss_serve.config import ServerConfig
from gptoss_serve.server.api_keys import bearer_token, check_api_key, masked
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import REASONING_THEN_FINAL, ScriptedEngine, harmony_tokens, running_server

KEY = "sk-local-0123456789abcdef"
OTHER_KEY = "second-key_!#"
BODY = {"model": "demo", "input": "Hi", "max_output_tokens": 64}


@pytest.fixture()
def engine() -> ScriptedEngine:
    engine = ScriptedEngine()
    engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    return engine


@pytest.fixture()
def client(engine: ScriptedEngine) -> Iterator[TestClient]:
    config = ServerConfig(api_keys=(KEY, OTHER_KEY))
    with TestClient(create_app(engine, ResponseStore(":memory:"), config)) as test_client:
        yield test_client


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_no_key_is_a_401_in_the_openai_shape(client: TestClient, engine: ScriptedEngine) -> None:
    for method, path in [("POST", "/v1/responses"), ("GET", "/v1/models"),
                         ("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
                         ("POST", "/v1/responses/input_tokens"), ("GET", "/v1")]:  # fmt: skip
        response = client.request(method, path, json=BODY)
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] is None and error["code"] is None
        assert "Authorization: Bearer" in error["message"]
    assert engine.prompts == []  # nothing reached the engine


def test_a_wrong_key_or_scheme_is_refused_and_the_key_masked(client: TestClient) -> None:
    wrong = "sk-wrong-key-that-is-long"
    response = client.post("/v1/responses", json=BODY, headers=_auth(wrong))
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key"
    assert wrong not in error["message"] and "sk-w" in error["message"]
    assert client.post("/v1/responses", json=BODY, headers=_auth(KEY[:-1])).status_code == 401
    assert client.post("/v1/responses", json=BODY, headers=_auth(KEY + "x")).status_code == 401
    for header in (f"Basic {KEY}", KEY, "Bearer", "Bearer "):
        response = client.post("/v1/responses", json=BODY, headers={"Authorization": header})
        assert response.status_code == 401, header
        assert response.json()["error"]["code"] is None  # read as no key at all


def test_either_key_opens_every_route(client: TestClient) -> None:
    created = client.post("/v1/responses", json=BODY, headers=_auth(KEY))
    assert created.status_code == 200
    response_id = created.json()["id"]
    fetched = client.get(f"/v1/responses/{response_id}", headers=_auth(OTHER_KEY))
    assert fetched.status_code == 200 and fetched.json()["id"] == response_id
    assert client.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    counted = client.post("/v1/responses/input_tokens", json={"input": "Hi"}, headers=_auth(KEY))
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def test_a_401_reads_no_body_and_beats_the_body_limit(engine: ScriptedEngine) -> None:
    config = ServerConfig(api_keys=(KEY,), max_request_bytes=1024)
    with TestClient(create_app(engine, ResponseStore(":memory:"), config)) as client:
        big = {"model": "demo", "input": "x" * 4096}
        assert client.post("/v1/responses", json=big).status_code == 401
        assert client.post("/v1/responses", json=big, headers=_auth(KEY)).status_code == 413
        assert client.post("/v1/responses", content=b"{not json").status_code == 401


def test_health_and_metrics_need_no_key(client: TestClient) -> None:
    for path in ("/health", "/healthz", "/metrics"):
        assert client.get(path).status_code == 200, path


def test_without_keys_the_server_is_open(engine: ScriptedEngine) -> None:
    with TestClient(create_app(engine, ResponseStore(":memory:"), ServerConfig())) as client:
        assert client.post("/v1/responses", json=BODY).status_code == 200
        assert client.post("/v1/responses", json=BODY, headers=_auth("anything")).status_code == 200


def test_the_sdk_sends_its_api_key(engine: ScriptedEngine) -> None:
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig(api_keys=(KEY,)))
    with running_server(app) as base_url:
        right = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
        assert right.responses.create(**BODY).output_text == "Hello there, friend! 👋"
        stream = right.responses.create(**BODY, stream=True)
        assert [event.type for event in stream][-1] == "response.completed"
        wrong = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-nope-nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:
            wrong.responses.create(**BODY)
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.responses.create(**BODY, stream=True)


def test_bench_serve_sends_the_key_and_keeps_it_out_of_the_results(engine: ScriptedEngine) -> None:
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig(api_keys=(KEY,)))
    with running_server(app) as base_url:
        base = {"base_url": base_url, "num_requests": 2, "concurrency": 2, "input_len": 32}
        config = serve_load.BenchServeConfig(**base, output_len=16, api_key=KEY)
        assert KEY not in repr(config) and "api_key" not in config.settings()
        run = asyncio.run(serve_load.run_benchmark(config))
        assert all(result.is_ok for result in run.results)
        with pytest.raises(serve_load.BenchError, match="HTTP 401: You didn't provide"):
            asyncio.run(
                serve_load.run_benchmark(serve_load.BenchServeConfig(**base, output_len=16))
            )


def test_keys_are_checked_and_read_from_the_environment() -> None:
    env = {"GPTOSS_SERVE_API_KEY": OTHER_KEY}
    assert cli.api_keys([KEY], env) == (KEY, OTHER_KEY)
    assert cli.api_keys([KEY, KEY], {}) == (KEY,)
    assert cli.api_keys(None, {"GPTOSS_SERVE_API_KEY": ""}) == ()
    for bad in ("", "has space", "é-key", "x" * 513):
        with pytest.raises(cli.UsageError, match="--api-key") as caught:
            cli.api_keys([bad], {})
        assert bad not in str(caught.value) or bad == ""
    with pytest.raises(ValueError, match="empty"):
        check_api_key("")
    assert "api_keys" not in repr(ServerConfig(api_keys=(KEY,)))


def test_helpers() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("  BEARER   abc  ") == "abc"
    assert bearer_token("Token abc") is None and bearer_token(None) is None
    assert masked("sk-0123456789") == "sk-0*****6789"
    assert masked("short") == "*****"
    assert len(masked("k" * 500)) == 24
