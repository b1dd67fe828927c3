"""CORS (`--allowed-origins`): off by default; preflights answered before the API keys' check;
a refused preflight in the OpenAI error shape; 401s readable by the page."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gptoss_serve import cli
from gptoss_serve.config import ServerConfig
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import REASONING_THEN_FINAL, ScriptedEngine, harmony_tokens

APP_ORIGIN = "https://app.example.com"
KEY = "sk-local-cors-key"
BODY = {"model": "demo", "input": "Hi", "max_output_tokens": 64}


def _client(**config) -> TestClient:
    engine = ScriptedEngine()
    engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    return TestClient(create_app(engine, ResponseStore(":memory:"), ServerConfig(**config)))


def _preflight(client: TestClient, origin: str, method: str = "POST"):
    return client.options(
        "/v1/responses",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
        },
    )


def test_preflight_passes_before_the_key_check_and_401s_carry_the_headers() -> None:
    with _client(allowed_origins=(APP_ORIGIN,), api_keys=(KEY,)) as client:
        preflight = _preflight(client, APP_ORIGIN)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == APP_ORIGIN
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "x-stainless-os" in preflight.headers["access-control-allow-headers"]
        refused = client.post("/v1/responses", json=BODY, headers={"Origin": APP_ORIGIN})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == APP_ORIGIN
        allowed = client.post(
            "/v1/responses", json=BODY,
            headers={"Origin": APP_ORIGIN, "Authorization": f"Bearer {KEY}"},
        )  # fmt: skip
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == APP_ORIGIN


def test_a_refused_preflight_is_an_openai_error() -> None:
    with _client(allowed_origins=(APP_ORIGIN,)) as client:
        for origin, method, reason in [("https://evil.example", "POST", "origin"),
                                       (APP_ORIGIN, "PUT", "method")]:  # fmt: skip
            response = _preflight(client, origin, method)
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["code"] == "cors_not_allowed" and reason in error["message"]
        other = client.post("/v1/responses", json=BODY, headers={"Origin": "https://evil.example"})
        assert other.status_code == 200  # the browser, not the server, withholds the answer
        assert "access-control-allow-origin" not in other.headers


def test_any_origin_and_none_by_default() -> None:
    with _client(allowed_origins=("*",)) as client:
        response = client.get("/v1/models", headers={"Origin": "https://anywhere.example"})
        assert response.headers["access-control-allow-origin"] == "*"
    with _client() as client:
        response = client.get("/v1/models", headers={"Origin": APP_ORIGIN})
        assert response.status_code == 200
        assert "access-control-allow-origin" not in response.headers


def test_origins_are_checked() -> None:
    assert cli.allowed_origins(None) == ()
    assert cli.allowed_origins(["*", APP_ORIGIN, APP_ORIGIN]) == ("*", APP_ORIGIN)
    assert cli.allowed_origins(["http://localhost:3000"]) == ("http://localhost:3000",)
    for bad in ("app.example.com", "https://app.example.com/", "ftp://x", "https://"):
        with pytest.raises(cli.UsageError, match="--allowed-origins"):
            cli.allowed_origins([bad])
