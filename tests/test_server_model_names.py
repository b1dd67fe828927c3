"""`--served-model-name`: the served model under several ids (one with a slash, as the Hugging
Face repository's), the first one on responses."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from fastapi.testclient import TestClient

from gptoss_serve import cli
from gptoss_serve.config import ServerConfig
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import REASONING_THEN_FINAL, ScriptedEngine, harmony_tokens, running_server

PRIMARY = "openai/gpt-oss-120b"
ALIAS = "gpt-oss-120b"


@pytest.fixture()
def engine() -> ScriptedEngine:
    engine = ScriptedEngine(model_name=PRIMARY)
    engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    return engine


@pytest.fixture()
def client(engine: ScriptedEngine) -> Iterator[TestClient]:
    config = ServerConfig(model_aliases=(ALIAS,))
    with TestClient(create_app(engine, ResponseStore(":memory:"), config)) as test_client:
        yield test_client


def test_models_lists_every_id_and_finds_one_with_a_slash(client: TestClient) -> None:
    listed = client.get("/v1/models").json()["data"]
    assert [model["id"] for model in listed] == [PRIMARY, ALIAS]
    assert client.get(f"/v1/models/{PRIMARY}").json()["id"] == PRIMARY
    assert client.get(f"/v1/models/{ALIAS}").json()["id"] == ALIAS
    missing = client.get("/v1/models/openai/other")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model_id"


def test_a_request_may_name_either_and_responses_carry_the_first(client: TestClient) -> None:
    for name in (PRIMARY, ALIAS):
        response = client.post("/v1/responses", json={"model": name, "input": "Hi"})
        assert response.status_code == 200 and response.json()["model"] == PRIMARY
        counted = client.post("/v1/responses/input_tokens", json={"model": name, "input": "Hi"})
        assert counted.status_code == 200
    unknown = client.post("/v1/responses", json={"model": "gpt-oss-20b", "input": "Hi"})
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert f"'{PRIMARY}', '{ALIAS}'" in error["message"]


def test_the_sdk_retrieves_an_id_with_a_slash(engine: ScriptedEngine) -> None:
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig(model_aliases=(ALIAS,)))
    with running_server(app) as base_url:
        sdk = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        assert sdk.models.retrieve(PRIMARY).id == PRIMARY
        assert [model.id for model in sdk.models.list()] == [PRIMARY, ALIAS]
        response = sdk.responses.create(model=ALIAS, input="Hi", max_output_tokens=64)
        assert response.model == PRIMARY and response.output_text == "Hello there, friend! 👋"


def test_served_names_from_the_command_line(tmp_path) -> None:
    assert cli.served_names(None, "demo") == ("demo",)
    assert cli.served_names(None, "synthetic-120b") == ("synthetic-120b",)
    assert cli.served_names(None, str(tmp_path / "gpt-oss-20b")) == ("gpt-oss-20b",)
    assert cli.served_names([PRIMARY, ALIAS, PRIMARY], "demo") == (PRIMARY, ALIAS)
    for bad in ("", " padded"):
        with pytest.raises(cli.UsageError, match="--served-model-name"):
            cli.served_names([bad], "demo")
    with pytest.raises(ValueError, match="aliases"):
        ServerConfig(model_aliases=("",))
    parsed = cli.build_parser().parse_args(
        ["serve", "--model", "demo", "--served-model-name", PRIMARY, ALIAS]
    )
    assert parsed.served_model_name == [PRIMARY, ALIAS]
