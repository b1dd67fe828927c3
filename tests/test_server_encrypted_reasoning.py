"""``include: ["reasoning.encrypted_content"]``: reasoning items carry their text in a form a
stateless client (``store: false``) sends back, and the next turn's prompt has it again."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from openai.types.responses import Response

from gptoss_serve.harmony import adapter
from gptoss_serve.server.reasoning_seal import seal, unseal
from server_helpers import PREAMBLE_AND_CALL, TOOLS, ScriptedEngine, harmony_tokens
from test_server_stream import _stream

INCLUDE = ["reasoning.encrypted_content"]


def _create(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/responses", json={"model": "demo", **body})
    assert response.status_code == 200, response.text
    Response.model_validate(response.json())
    return response.json()


def test_reasoning_items_carry_their_text_sealed(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    scripted_engine.queue(harmony_tokens(PREAMBLE_AND_CALL))
    data = _create(scripted_client, input="Weather?", tools=TOOLS, include=INCLUDE)
    reasoning = data["output"][0]
    assert reasoning["type"] == "reasoning"
    assert (
        unseal(reasoning["encrypted_content"]) == "Need weather." == reasoning["content"][0]["text"]
    )
    scripted_engine.queue(harmony_tokens(PREAMBLE_AND_CALL))
    events, final = _stream(scripted_client, input="Weather?", tools=TOOLS, include=INCLUDE)
    added, done = (e for e in events if e["type"].startswith("response.output_item.")
                   and e["output_index"] == 0)  # fmt: skip
    assert added["item"]["encrypted_content"] is None
    assert unseal(done["item"]["encrypted_content"]) == "Need weather."
    assert final["output"][0] == done["item"]
    scripted_engine.queue(harmony_tokens(PREAMBLE_AND_CALL))
    plain = _create(scripted_client, input="Weather?", tools=TOOLS)
    assert plain["output"][0]["encrypted_content"] is None


def test_a_stateless_tool_loop_keeps_the_reasoning(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    """Turn 1 without storing; turn 2 sends its output back with the reasoning's text only in
    encrypted_content, and the function's output: the prompt holds the analysis again (a
    tool loop in progress keeps it)."""
    scripted_engine.queue(harmony_tokens(PREAMBLE_AND_CALL))
    first = _create(scripted_client, input="Weather?", tools=TOOLS, include=INCLUDE, store=False)
    reasoning, preamble, call = first["output"]
    reasoning = {k: v for k, v in reasoning.items() if k != "content"}  # as a stateless client
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "12 C"}
    turn = [{"role": "user", "content": "Weather?"}, reasoning, preamble, call, output]
    _create(scripted_client, input=turn, tools=TOOLS, include=INCLUDE, store=False)
    prompt = adapter.encoding().decode(scripted_engine.prompts[-1])
    assert "<|channel|>analysis<|message|>Need weather.<|end|>" in prompt
    assert prompt.index("Need weather.") < prompt.index("12 C")


def test_encrypted_content_not_made_here_is_a_400(scripted_client: TestClient) -> None:
    for value in (
        "gAAAAABo-another-providers-ciphertext",
        "gptoss-serve.v1.not-base64!",
        seal("x")[:-4],
    ):
        item = {"type": "reasoning", "summary": [], "encrypted_content": value}
        body = {"model": "demo", "input": [{"role": "user", "content": "Hi"}, item]}
        response = scripted_client.post("/v1/responses", json=body)
        assert response.status_code == 400, value
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("input[1].encrypted_content",
                                                   "invalid_encrypted_content")  # fmt: skip
