"""``namespace`` tools (the SDK's NamespaceTool), as the Codex CLI declares its sub-agent tools:
Harmony declares each namespace on its own, the model calls ``{namespace}.{name}``, the call's
item carries ``namespace``, and the call goes back into the next prompt in its namespace.
Also a request shaped like the Codex CLI's (0.171) own, turn after turn."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseFunctionToolCall

from gptoss_serve.constrain.grammar import build_grammar
from gptoss_serve.harmony.adapter import decode
from gptoss_serve.server.constraints import constraint_spec
from gptoss_serve.server.protocol import CreateResponseRequest
from server_helpers import TOOLS, ScriptedEngine, harmony_tokens, scripted_server
from test_constrained_generation import _accepts
from test_server_errors import assert_error, with_base

AGENTS = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "task": {"type": "string"}}, "required": ["task"]}},
        {"type": "function", "name": "close_agent", "description": "Close a sub-agent.",
         "strict": True, "parameters": {"type": "object", "properties": {
             "target": {"type": "string"}}, "required": ["target"],
             "additionalProperties": False}},
    ],
}  # fmt: skip
CLOSE_CALL = (
    "<|channel|>analysis<|message|>Close it.<|end|><|start|>assistant<|channel|>commentary "
    'to=multi_agent_v1.close_agent <|constrain|>json<|message|>{"target": "a1"}<|call|>'
)
ANSWER = (
    "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Closed.<|return|>"
)
TOP_LEVEL_CALL = (
    "<|channel|>analysis<|message|>Weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'
)


def prompt_text(engine: ScriptedEngine, index: int = -1) -> str:
    return decode(engine.prompts[index])


def test_a_namespace_is_declared_in_the_developer_message() -> None:
    with scripted_server(ANSWER) as (_, client, engine):
        client.responses.create(model="demo", input="Close a1.", tools=[*TOOLS, AGENTS])
    prompt = prompt_text(engine)
    functions = prompt.index("namespace functions {")
    agents = prompt.index(
        "## multi_agent_v1\n\n// Tools for spawning and managing sub-agents.\n"
        "namespace multi_agent_v1 {\n\n// Start a sub-agent.\ntype spawn_agent = "
    )
    assert functions < agents < prompt.index("} // namespace multi_agent_v1<|end|>")
    assert "channel: 'functions'" in prompt  # the system message's rule for the calls


def test_a_call_into_a_namespace_names_it_in_every_form() -> None:
    with scripted_server(CLOSE_CALL) as (_, client, _engine):
        created = client.responses.create(model="demo", input="Close a1.", tools=[AGENTS])
        with client.responses.stream(model="demo", input="Close a1.", tools=[AGENTS]) as stream:
            events = list(stream)
            streamed = stream.get_final_response()
    for response in (created, streamed):
        call = response.output[-1]
        assert isinstance(call, ResponseFunctionToolCall)
        assert (call.namespace, call.name, call.arguments) == (
            "multi_agent_v1", "close_agent", '{"target": "a1"}'
        )  # fmt: skip
    added = [e for e in events if e.type == "response.output_item.added"][-1]
    done = [e for e in events if e.type == "response.output_item.done"][-1]
    assert added.item.namespace == done.item.namespace == "multi_agent_v1"
    assert added.item.call_id == done.item.call_id == streamed.output[-1].call_id


def test_a_top_level_call_has_no_namespace_field() -> None:
    with scripted_server(TOP_LEVEL_CALL) as (url, _, _engine):
        body = {"model": "demo", "input": "Weather?", "tools": [*TOOLS, AGENTS]}
        raw = openai.OpenAI(base_url=f"{url}/v1", api_key="none").responses.with_raw_response
        data = json.loads(raw.create(**body).text)
    call = data["output"][-1]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert "namespace" not in call
    Response.model_validate(data)


@pytest.mark.parametrize("chained", [True, False])
def test_a_namespaced_call_goes_back_in_its_namespace(chained: bool) -> None:
    """By previous_response_id (the stored output) or sent back as the SDK returned it."""
    with scripted_server(ANSWER) as (_, client, engine):
        engine.queue(harmony_tokens(CLOSE_CALL), harmony_tokens(ANSWER))
        first = client.responses.create(model="demo", input="Close a1.", tools=[AGENTS])
        call = first.output[-1]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "closed"}
        if chained:
            second = client.responses.create(model="demo", previous_response_id=first.id,
                                             input=[result], tools=[AGENTS])  # fmt: skip
        else:
            history = [{"role": "user", "content": "Close a1."}]
            history += [item.model_dump(exclude_none=True) for item in first.output]
            second = client.responses.create(model="demo", input=[*history, result],
                                             tools=[AGENTS], store=False)  # fmt: skip
    assert second.output_text == "Closed."
    prompt = prompt_text(engine)
    call_at = prompt.index(
        'to=multi_agent_v1.close_agent <|constrain|>json<|message|>{"target": "a1"}<|call|>'
    )
    output_at = prompt.index(
        "<|start|>multi_agent_v1.close_agent to=assistant<|channel|>commentary<|message|>closed"
        "<|end|>"
    )
    assert call_at < output_at


def test_a_call_sent_back_without_its_namespace_is_a_top_level_call() -> None:
    with scripted_server(ANSWER) as (_, client, engine):
        items = [
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}",
             "namespace": None},
            {"type": "function_call_output", "call_id": "c1", "output": "12 C", "namespace": None},
        ]  # fmt: skip
        client.responses.create(model="demo", input=items, tools=TOOLS)
    assert "<|start|>functions.get_weather to=assistant" in prompt_text(engine)


def _spec(**fields: Any):
    request = CreateResponseRequest.model_validate(with_base(**fields))
    return constraint_spec(request, budget=0)


def test_the_grammar_takes_a_namespace_s_recipients() -> None:
    spec = _spec(tools=[*TOOLS, AGENTS], tool_choice="required")
    assert [tool.recipient for tool in spec.tools] == [
        "functions.get_weather", "multi_agent_v1.spawn_agent", "multi_agent_v1.close_agent"
    ]  # fmt: skip
    grammar = build_grammar(spec)
    close = "<|channel|>commentary to=multi_agent_v1.close_agent <|constrain|>json<|message|>"
    assert _accepts(grammar, close + '{"target": "a1"}<|call|>')
    assert not _accepts(grammar, close + '{"other": 1}<|call|>')  # strict: its schema holds
    assert not _accepts(grammar, "<|channel|>commentary to=functions.close_agent ")
    assert not _accepts(grammar, "<|channel|>commentary to=multi_agent_v1.get_weather ")
    named = _spec(tools=[*TOOLS, AGENTS], tool_choice={"type": "function", "name": "get_weather"})
    assert [tool.recipient for tool in named.tools] == ["functions.get_weather"]


def test_a_forced_call_may_go_to_a_namespace_only() -> None:
    with scripted_server(CLOSE_CALL) as (_, client, engine):
        engine.enforce_grammar = True
        response = client.responses.create(model="demo", input="Close a1.", tools=[AGENTS],
                                           tool_choice="required")  # fmt: skip
    assert response.output[-1].namespace == "multi_agent_v1"


def _namespace(**changes: Any) -> dict[str, Any]:
    return {**AGENTS, **changes}


FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([_namespace(name="functions")], "tools[0].name"),
        ([AGENTS, {**AGENTS, "description": "again"}], "tools[1].name"),
        ([_namespace(tools=[FUNCTION, FUNCTION])], "tools[0].tools[1].name"),
        ([_namespace(name="a.b")], "tools[0].name"),
        ([_namespace(tools=[])], "tools[0].tools"),
        ([{k: v for k, v in AGENTS.items() if k != "description"}], "tools[0].description"),
        ([_namespace(tools=[{"type": "custom", "name": "apply_patch"}])], "tools[0].tools[0].type"),
        ([_namespace(tools=[{**FUNCTION, "defer_loading": True}])],
         "tools[0].tools[0].defer_loading"),
        ([_namespace(tools=[{**FUNCTION, "strict": True, "parameters": {"type": "nope"}}])],
         "tools[0].tools[0].parameters"),
        ([*TOOLS, _namespace(tools=[{**FUNCTION, "name": f"f{i}"} for i in range(128)])], "tools"),
        ([{"type": "web_search", "external_web_access": False}], "tools[0].type"),
    ],
)  # fmt: skip
def test_a_bad_namespace_is_a_400_naming_the_field(
    scripted_client: TestClient, tools: list, param: str
) -> None:
    response = scripted_client.post("/v1/responses", json=with_base(tools=tools))
    assert_error(response, 400, param)


def test_a_hosted_tool_is_a_400_that_names_its_type(scripted_client: TestClient) -> None:
    """The Codex CLI sends web_search unless its config says `web_search = "disabled"`."""
    body = with_base(tools=[*TOOLS, {"type": "web_search", "external_web_access": False}])
    response = scripted_client.post("/v1/responses", json=body)
    assert_error(response, 400, "tools[1].type")
    assert response.json()["error"]["message"] == (
        "Invalid value for 'tools[1].type': \"web_search\" is not a supported type "
        "(supported: 'function', 'namespace')."
    )


def test_the_same_function_name_may_live_in_two_namespaces(scripted_client: TestClient) -> None:
    tools = [FUNCTION, _namespace(tools=[FUNCTION]), _namespace(name="other", tools=[FUNCTION])]
    response = scripted_client.post("/v1/responses", json=with_base(tools=tools))
    assert response.status_code == 200, response.text


def test_tool_choice_names_top_level_functions_only(scripted_client: TestClient) -> None:
    choice = {"type": "function", "name": "close_agent"}
    body = with_base(tools=[*TOOLS, AGENTS], tool_choice=choice)
    assert_error(scripted_client.post("/v1/responses", json=body), 400, "tool_choice.name")


def test_the_input_token_count_takes_namespaces(scripted_client: TestClient) -> None:
    body = {"model": "demo", "input": "Hi", "tools": [AGENTS]}
    counted = scripted_client.post("/v1/responses/input_tokens", json=body)
    assert counted.status_code == 200, counted.text
    scripted_client.post("/v1/responses", json=body)
    assert counted.json()["input_tokens"] > 100


# -- a request shaped as the Codex CLI 0.171 sends it (short texts, the same fields) -----------

CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "strict": False,
     "description": "Runs a command in a PTY, returning output or a session ID.",
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"},
                    "yield_time_ms": {"type": "number"}}, "required": ["cmd"],
                    "additionalProperties": False}},
    {"type": "function", "name": "view_image", "strict": False, "description": "View an image.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                    "required": ["path"], "additionalProperties": False}},
    AGENTS,
    {"type": "function", "name": "get_goal", "strict": False, "description": "The goal.",
     "parameters": {"type": "object", "properties": {}, "required": [],
                    "additionalProperties": False}},
]  # fmt: skip
CODEX_METADATA = {
    "turn_id": "01a22a51-33d9-7b02-b343-f25dedd3b7ea",
    "x-codex-turn-metadata": json.dumps({"session_id": "s", "sandbox": "seccomp"} | {
        f"field_{i}": "x" * 40 for i in range(20)}),  # longer than metadata's 512 characters
    "session_id": "01a22a51-33c0-7390-b0de-9a5297f94289",
}  # fmt: skip
LS_CALL = (
    "<|channel|>analysis<|message|>List files.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.exec_command <|constrain|>json<|message|>{"cmd":"ls -a"}<|call|>'
)


def codex_body(input_items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": "demo", "stream": True, "tools": CODEX_TOOLS, "tool_choice": "auto",
        "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "01a22a51-33c0",
        "client_metadata": CODEX_METADATA, "input": input_items,
    }  # fmt: skip


def _codex_item(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the Codex CLI sends it back (its own field order and ids)."""
    if item["type"] == "function_call":
        keep = ("type", "status", "id", "name", "namespace", "arguments", "call_id")
        return {key: item[key] for key in keep if key in item}
    if item["type"] == "reasoning":
        return {k: item[k] for k in ("type", "id", "summary", "content", "encrypted_content")}
    return item


def test_a_codex_cli_turn_loop(scripted_client: TestClient, scripted_engine) -> None:
    scripted_engine.queue(*(harmony_tokens(s) for s in (LS_CALL, CLOSE_CALL, ANSWER)))
    items: list[dict[str, Any]] = [
        {"type": "message", "id": "msg_d24a", "role": "developer",
         "content": [{"type": "input_text", "text": "You are a coding agent."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
    ]  # fmt: skip
    outputs = ["a.txt\nb.txt\n", "invalid agent id a1"]
    for turn in range(3):
        with scripted_client.stream("POST", "/v1/responses", json=codex_body(items)) as stream:
            assert stream.status_code == 200, stream.read()
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        final = json.loads(lines[-1].removeprefix("data: "))
        assert final["type"] == "response.completed", final
        if turn == 2:
            break
        for item in final["response"]["output"]:
            items.append(_codex_item(item))
        call = items[-1]
        assert call["type"] == "function_call"
        items.append({"type": "function_call_output", "id": f"fco_{turn}",
                      "call_id": call["call_id"], "output": outputs[turn]})  # fmt: skip
    assert final["response"]["output"][-1]["content"][0]["text"] == "Closed."
    assert items[-2]["namespace"] == "multi_agent_v1"
    assert "client_metadata" not in final["response"]
    last = prompt_text(scripted_engine)
    assert "<|start|>multi_agent_v1.close_agent to=assistant" in last
    assert "<|start|>functions.exec_command to=assistant" in last
    assert last.count("<|channel|>analysis") == 2  # the loop's reasoning stays in the prompt
