"""The server side of constrained decoding: the spec of each tool_choice and text.format, the
reasoning budget, and a 400 naming the schema the grammar library cannot take."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from gptoss_serve.config import ServerConfig
from gptoss_serve.constrain.grammar import ANY_OBJECT
from gptoss_serve.server import constraints, protocol
from gptoss_serve.server.app import create_app
from gptoss_serve.server.constraints import constraint_spec, reasoning_budget
from gptoss_serve.server.protocol import CreateResponseRequest
from gptoss_serve.server.store import ResponseStore
from server_helpers import (
    PREAMBLE_AND_CALL,
    REASONING_THEN_FINAL,
    RECIPIENT_IN_ROLE,
    ScriptedEngine,
    harmony_tokens,
)

PARAMETERS = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def _tool(name: str, *, strict: bool = False, parameters: dict | None = None) -> dict[str, Any]:
    return {"type": "function", "name": name, "parameters": parameters or PARAMETERS,
            "strict": strict}  # fmt: skip


def _request(**fields: Any) -> CreateResponseRequest:
    return CreateResponseRequest.model_validate({"model": "demo", "input": "Hi", **fields})


TOOLS = [_tool("a"), _tool("b", strict=True), _tool("c")]


def test_auto_calls_any_tool_and_only_strict_ones_are_schema_checked() -> None:
    spec = constraint_spec(_request(tools=TOOLS), budget=7)
    assert [tool.name for tool in spec.tools] == ["a", "b", "c"]
    assert [tool.parameters for tool in spec.tools] == [ANY_OBJECT, PARAMETERS, ANY_OBJECT]
    assert not spec.require_call and spec.response_schema is None and spec.reasoning_budget == 7


@pytest.mark.parametrize(
    ("tool_choice", "names", "require_call"),
    [
        ("required", ["a", "b", "c"], True),
        ({"type": "function", "name": "c"}, ["c"], True),
        ({"type": "allowed_tools", "mode": "required", "tools": [
            {"type": "function", "name": "c"}, {"type": "function", "name": "a"}]},
         ["a", "c"], True),
        ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "b"}]},
         ["b"], False),
        ("none", [], False),
    ],
)  # fmt: skip
def test_tool_choice(tool_choice: Any, names: list[str], require_call: bool) -> None:
    spec = constraint_spec(_request(tools=TOOLS, tool_choice=tool_choice), budget=0)
    assert [tool.name for tool in spec.tools] == names and spec.require_call is require_call
    if require_call:  # a forced call's arguments always match the parameters
        assert all(tool.parameters == PARAMETERS for tool in spec.tools)


def test_text_formats() -> None:
    schema = {"type": "object", "properties": {}}
    fmt = {"type": "json_schema", "name": "x", "schema": schema}
    assert constraint_spec(_request(text={"format": fmt}), 0).response_schema == schema
    json_object = {"format": {"type": "json_object"}}
    assert constraint_spec(_request(text=json_object), 0).response_schema == ANY_OBJECT
    assert constraint_spec(_request(), 0).response_schema is None


def test_reasoning_budget_defaults_per_effort_capped_at_half_the_output() -> None:
    config = ServerConfig(reasoning_budget_low=10, reasoning_budget_medium=100)
    assert reasoning_budget(_request(), "low", 1000, config) == 10
    assert reasoning_budget(_request(), "medium", 1000, config) == 100
    assert reasoning_budget(_request(), "medium", 50, config) == 25
    # Asked for: the request's own budget is used as it is, even above the cap.
    assert reasoning_budget(_request(reasoning_budget=80), "medium", 50, config) == 80
    with pytest.raises(ValueError, match="reasoning_budget_high"):
        ServerConfig(reasoning_budget_high=-1)


def _client(engine: ScriptedEngine) -> TestClient:
    return TestClient(create_app(engine, ResponseStore(":memory:"), ServerConfig()))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}},
         "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x",
                              "schema": {"type": "array", "uniqueItems": True}}}},
         "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x",
                              "schema": {"$ref": "#/$defs/missing"}}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x",
                              "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}},
         "text.format.schema"),
        ({"tools": [_tool("a"), _tool("b", strict=True, parameters={"not": {}})]},
         "tools[1].parameters"),
        ({"tools": [_tool("a", parameters={"type": 5})], "tool_choice": "required"},
         "tools[0].parameters"),
        ({"tools": [_tool("a"), _tool("b", parameters={"type": 5})],
          "tool_choice": {"type": "function", "name": "b"}}, "tools[1].parameters"),
    ],
)  # fmt: skip
def test_unsupported_or_invalid_schemas_are_a_400_naming_them(fields: dict, param: str) -> None:
    engine = ScriptedEngine([harmony_tokens(REASONING_THEN_FINAL)])
    with _client(engine) as client:
        response = client.post("/v1/responses", json={"model": "demo", "input": "Hi", **fields})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["code"] == "invalid_json_schema"
        assert error["type"] == "invalid_request_error" and "JSON Schema" in error["message"]
        assert not engine.prompts  # nothing ran
        assert client.get("/health").status_code == 200


def test_a_schema_is_checked_once_however_often_it_is_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Agents send the same tools with every request: the metaschema check (~2 ms) is cached by
    # the schema's canonical JSON, and a bad schema is still refused each time.
    checked: list[Any] = []
    real = protocol.validator_for

    def counting(schema, default):
        checked.append(schema)
        return real(schema, default=default)

    monkeypatch.setattr(protocol, "validator_for", counting)
    protocol._schema_problem.cache_clear()  # whatever earlier tests checked
    parameters = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 7}}}
    reordered = {"properties": {"n": {"minimum": 7, "type": "integer"}}, "type": "object"}
    bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": "seven"}}}
    for schema in (parameters, reordered, parameters):
        CreateResponseRequest.model_validate(
            {"model": "demo", "input": "Hi", "tools": [_tool("a", parameters=schema)]}
        )
    assert len(checked) == 1  # key order does not make another schema
    engine = ScriptedEngine([harmony_tokens(REASONING_THEN_FINAL)])
    with _client(engine) as client:
        for _ in range(2):
            response = client.post("/v1/responses", json={
                "model": "demo", "input": "Hi", "tools": [_tool("a", parameters=bad)],
            })  # fmt: skip
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "tools[0].parameters"
            assert error["code"] == "invalid_json_schema" and "minimum" in error["message"]
    assert len(checked) == 2


def test_a_non_strict_tool_under_auto_is_not_schema_checked() -> None:
    engine = ScriptedEngine([harmony_tokens(REASONING_THEN_FINAL)])
    tools = [_tool("a", parameters={"type": "object", "not": {}})]
    with _client(engine) as client:
        response = client.post("/v1/responses", json={"model": "demo", "input": "Hi",
                                                      "tools": tools})  # fmt: skip
        assert response.status_code == 200, response.text


def test_reasoning_budget_extension_field() -> None:
    engine = ScriptedEngine([harmony_tokens(REASONING_THEN_FINAL)])
    with _client(engine) as client:
        ok = client.post("/v1/responses", json={"model": "demo", "input": "Hi",
                                                "reasoning_budget": 3})  # fmt: skip
        assert ok.status_code == 200
        assert "analysis_text[max_tokens=3]" in engine.params[-1].grammar
        assert "reasoning_budget" not in ok.json()  # not echoed: the SDK's type lacks it
        bad = client.post("/v1/responses", json={"model": "demo", "input": "Hi",
                                                 "reasoning_budget": -1})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_budget"


def test_every_request_gets_a_grammar_and_well_formed_scripts_pass_it() -> None:
    scripts = [REASONING_THEN_FINAL, PREAMBLE_AND_CALL, RECIPIENT_IN_ROLE]
    engine = ScriptedEngine([harmony_tokens(s) for s in scripts], enforce_grammar=True)
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    with _client(engine) as client:
        plain = client.post("/v1/responses", json={"model": "demo", "input": "Hi"}).json()
        call = client.post("/v1/responses", json={"model": "demo", "input": "Hi",
                                                  "tools": tools}).json()  # fmt: skip
        # The grammar writes the recipient after the channel only, as our renderer does.
        other = client.post("/v1/responses", json={"model": "demo", "input": "Hi",
                                                   "tools": tools}).json()  # fmt: skip
    assert plain["status"] == "completed" and call["status"] == "completed"
    assert [item["type"] for item in call["output"]] == ["reasoning", "message", "function_call"]
    assert other["status"] == "failed"
    assert all(params.grammar for params in engine.params)


def test_startup_builds_the_grammar_tokenizer_and_default_grammar(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first request must not wait ~2 s for the grammar library's tokenizer: the app's
    start-up builds it and compiles a plain request's grammar."""
    calls = []
    real = constraints.warm_up
    monkeypatch.setattr(constraints, "warm_up", calls.append)
    config = ServerConfig()
    app = create_app(ScriptedEngine([]), ResponseStore(":memory:"), config)
    assert not calls
    with TestClient(app):
        assert calls == [config]
    real(config)  # compiles (or finds) the default grammar, raising on a bad one


def test_a_schema_nothing_can_match_is_a_400_without_the_librarys_state_dump() -> None:
    engine = ScriptedEngine([harmony_tokens(REASONING_THEN_FINAL)])
    with _client(engine) as client:
        response = client.post("/v1/responses", json={
            "model": "demo", "input": "Hi",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#"}}},
        })  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "text.format.schema" and error["code"] == "invalid_json_schema"
    assert "nothing can match it" in error["message"]
    assert "\n" not in error["message"] and "<state>" not in error["message"]


def test_only_small_schemas_stay_in_the_check_cache() -> None:
    protocol._schema_problem.cache_clear()
    huge = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(3000)}}
    for _ in range(2):
        CreateResponseRequest.model_validate(
            {"model": "demo", "input": "Hi", "tools": [_tool("a", parameters=huge)]}
        )
    assert protocol._schema_problem.cache_info().currsize == 0  # checked, not kept
    bad = {**huge, "required": "field_0"}  # not an array: still refused when not cached
    with pytest.raises(ValueError, match="not valid JSON Schema"):
        CreateResponseRequest.model_validate(
            {"model": "demo", "input": "Hi", "tools": [_tool("a", parameters=bad)]}
        )
