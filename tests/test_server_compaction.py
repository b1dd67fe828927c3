"""``POST /v1/responses/compact`` (the SDK's ``client.responses.compact``) and ``compaction``
input items: a conversation becomes its user messages and one compaction item whose summary
the model wrote; sent back, the summary stands in for the items it replaced."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from openai.types.responses import (
    CompactedResponse,
    Response,
    ResponseCompactionItem,
    ResponseInputMessageItem,
)

from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.client import EngineInfo
from gptoss_serve.harmony.adapter import decode
from gptoss_serve.harmony.render import COMPACTION_INTRO
from gptoss_serve.server.app import create_app
from gptoss_serve.server.compaction import REASONING_BUDGET, SUMMARY_REQUEST, SUMMARY_TOKENS
from gptoss_serve.server.reasoning_seal import COMPACTION_PREFIX, seal, unseal
from gptoss_serve.server.store import ResponseStore
from server_helpers import PREAMBLE_AND_CALL, TOOLS, ScriptedEngine, harmony_tokens, scripted_server
from test_server_encrypted_reasoning import _create
from test_server_errors import assert_error
from test_server_stream import EVENT_TYPES, sse_events

SUMMARY = "Asked for the weather in Oslo: 12 C and sunny. Nothing left to do."
SUMMARY_REPLY = (
    "<|channel|>analysis<|message|>Summarise.<|end|><|start|>assistant<|channel|>final"
    f"<|message|>{SUMMARY}<|return|>"
)
ANSWER = "<|channel|>final<|message|>It is sunny.<|return|>"


def _compact(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/responses/compact", json={"model": "demo", **body})
    assert response.status_code == 200, response.text
    data = response.json()
    # The SDK types the output as output items, which have no user message: the user
    # messages are input messages (as the official API's), the last item the compaction.
    *users, item = data["output"]
    for user in users:
        ResponseInputMessageItem.model_validate(user)
    ResponseCompactionItem.model_validate(item)
    CompactedResponse.model_validate({**data, "output": [item]})
    return data


def test_a_conversation_compacts_to_its_user_messages_and_a_summary(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    scripted_engine.queue(harmony_tokens(PREAMBLE_AND_CALL))
    first = _create(scripted_client, input="Weather in Oslo?", tools=TOOLS)
    call = first["output"][-1]
    scripted_engine.queue(harmony_tokens(SUMMARY_REPLY))
    later = [{"type": "function_call_output", "call_id": call["call_id"], "output": "12 C"},
             {"id": "msg_mine", "role": "user", "content": "And tomorrow?"}]  # fmt: skip
    compact = _compact(scripted_client, previous_response_id=first["id"], input=later,
                       instructions="Be brief.")  # fmt: skip
    assert compact["object"] == "response.compaction"
    *users, item = compact["output"]
    assert [(u["role"], u["content"]) for u in users] == [
        ("user", [{"type": "input_text", "text": "Weather in Oslo?"}]),
        ("user", [{"type": "input_text", "text": "And tomorrow?"}]),
    ]
    assert users[1]["id"] == "msg_mine"  # an input message keeps its id
    assert set(item) == {"id", "type", "encrypted_content"} and item["type"] == "compaction"
    assert item["encrypted_content"].startswith(COMPACTION_PREFIX)
    assert unseal(item["encrypted_content"], COMPACTION_PREFIX) == SUMMARY
    usage = compact["usage"]
    assert usage["input_tokens"] == len(scripted_engine.prompts[-1])
    assert usage["output_tokens"] == len(harmony_tokens(SUMMARY_REPLY))
    # The summary's prompt: the whole conversation under the instructions, then the request
    # for it; no tools declared; brief reasoning, room for the summary, stored nowhere.
    prompt = decode(scripted_engine.prompts[-1])
    assert "Be brief." in prompt and "namespace functions" not in prompt
    assert "12 C" in prompt and "to=functions.get_weather" in prompt
    assert prompt.endswith(f"<|start|>user<|message|>{SUMMARY_REQUEST}<|end|><|start|>assistant")
    params = scripted_engine.params[-1]
    assert params.max_tokens == REASONING_BUDGET + SUMMARY_TOKENS
    assert f"analysis_text[max_tokens={REASONING_BUDGET}]" in params.grammar
    assert scripted_client.get(f"/v1/responses/{compact['id']}").status_code == 404


def test_the_compacted_output_sent_back_continues_the_conversation(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    scripted_engine.queue(harmony_tokens(SUMMARY_REPLY))
    compact = _compact(scripted_client, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "12 C."},
    ])  # fmt: skip
    scripted_engine.queue(harmony_tokens(ANSWER))
    turn = _create(scripted_client, input=[*compact["output"],
                                           {"role": "user", "content": "Tomorrow?"}])  # fmt: skip
    prompt = decode(scripted_engine.prompts[-1])
    assert prompt.endswith(
        "<|start|>user<|message|>Weather in Oslo?<|end|>"
        f"<|start|>user<|message|>{COMPACTION_INTRO}{SUMMARY}<|end|>"
        "<|start|>user<|message|>Tomorrow?<|end|><|start|>assistant"
    )
    assert "12 C." not in prompt  # what the summary replaced
    # The item is kept as it came (no status), in the input items and in the chain after it.
    listed = scripted_client.get(f"/v1/responses/{turn['id']}/input_items?order=asc").json()
    assert listed["data"][1] == compact["output"][1]
    scripted_engine.queue(harmony_tokens(ANSWER))
    _create(scripted_client, previous_response_id=turn["id"], input="And after?")
    assert f"{COMPACTION_INTRO}{SUMMARY}" in decode(scripted_engine.prompts[-1])
    # By reference, as any stored input item.
    scripted_engine.queue(harmony_tokens(ANSWER))
    item_id = compact["output"][1]["id"]
    _create(scripted_client, input=[{"type": "item_reference", "id": item_id}])
    assert decode(scripted_engine.prompts[-1]).endswith(
        f"<|start|>user<|message|>{COMPACTION_INTRO}{SUMMARY}<|end|><|start|>assistant"
    )


def test_a_second_compaction_summarises_the_first(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    earlier = {"type": "compaction", "encrypted_content": seal("Old summary.", COMPACTION_PREFIX)}
    scripted_engine.queue(harmony_tokens(SUMMARY_REPLY))
    compact = _compact(scripted_client, input=[
        {"role": "user", "content": "First."}, earlier, {"role": "user", "content": "Second."},
    ])  # fmt: skip
    assert [o["type"] for o in compact["output"]] == ["message", "message", "compaction"]
    assert f"{COMPACTION_INTRO}Old summary." in decode(scripted_engine.prompts[-1])


def test_a_string_input_and_a_conversation_item(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    scripted_engine.queue(harmony_tokens(SUMMARY_REPLY))
    compact = _compact(scripted_client, input="Just this.")
    assert compact["output"][0]["content"][0]["text"] == "Just this."
    item = compact["output"][-1]
    created = scripted_client.post("/v1/conversations", json={"items": [item]})
    assert created.status_code == 200, created.text
    conversation = created.json()["id"]
    listed = scripted_client.get(f"/v1/conversations/{conversation}/items").json()["data"]
    assert listed == [item]
    scripted_engine.queue(harmony_tokens(ANSWER))
    _create(scripted_client, conversation=conversation, input="Go on.")
    assert f"{COMPACTION_INTRO}{SUMMARY}" in decode(scripted_engine.prompts[-1])


def test_a_long_conversation_is_summarised_from_its_latest_items() -> None:
    """A conversation near the context's end: the summary's prompt drops its oldest items to
    leave the summary room; the output still lists every user message."""
    engine = ScriptedEngine()
    engine.info = EngineInfo("demo", 4000, 201088, created_at=1700000000)
    engine.last_script = harmony_tokens(SUMMARY_REPLY)
    words = " ".join(["word"] * 300)
    conversation = [{"role": "user", "content": f"Message {n}: {words}"} for n in range(8)]
    with TestClient(create_app(engine, ResponseStore(":memory:"), ServerConfig())) as client:
        compact = _compact(client, input=conversation)
    assert len(compact["output"]) == 9
    prompt = decode(engine.prompts[-1])
    assert "Message 0:" not in prompt and "Message 7:" in prompt
    assert len(engine.prompts[-1]) + REASONING_BUDGET + SUMMARY_TOKENS <= 4000


# The SDK types the compacted output as output items: dumping its user messages back as input
# warns that an input_text part is not an output_text one (as with the official API's).
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
def test_the_sdk_compacts() -> None:
    with scripted_server(SUMMARY_REPLY) as (_, client, _engine):
        first = client.responses.create(model="demo", input="Weather in Oslo?")
        compact = client.responses.compact(model="demo", previous_response_id=first.id)
        assert isinstance(compact, CompactedResponse)
        assert compact.output[-1].type == "compaction"
        nxt = client.responses.create(
            model="demo", input=[*compact.output, {"role": "user", "content": "More?"}]
        )
        assert nxt.status == "completed"


def test_bad_compactions_are_400s(scripted_client: TestClient) -> None:
    def post(path: str = "/v1/responses/compact", **body: Any):
        return scripted_client.post(path, json={"model": "demo", **body})

    assert_error(post(), 400, "input")  # nothing to compact
    assert_error(post(input=[]), 400, "input")
    assert_error(post(model="gpt-4o", input="Hi"), 404, "model", "model_not_found")
    assert_error(post(previous_response_id="resp_nope"), 404, "previous_response_id",
                 "previous_response_not_found")  # fmt: skip
    assert_error(post(input="Hi", tools=[]), 400, "tools")  # not a field of compact
    assert_error(post(input="Hi", image={"context_compression": "maybe"}), 400,
                 "image.context_compression")  # fmt: skip
    forged = {"type": "compaction", "encrypted_content": "opaque-from-elsewhere"}
    for path in ("/v1/responses/compact", "/v1/responses"):
        assert_error(post(path, input=[forged]), 400, "input[0].encrypted_content",
                     "invalid_encrypted_content")  # fmt: skip
    # A reasoning item's sealed text is not a compaction's.
    reasoning = {"type": "compaction", "encrypted_content": seal("thoughts")}
    assert_error(post("/v1/responses", input=[reasoning]), 400, "input[0].encrypted_content",
                 "invalid_encrypted_content")  # fmt: skip
    assert_error(post("/v1/responses", input=[{"type": "compaction"}]), 400,
                 "input[0].encrypted_content")  # fmt: skip


def test_a_failed_summary_is_a_server_error(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    scripted_engine.queue([*harmony_tokens("<|channel|>final<|message|>Sum"), RuntimeError("x")])
    response = scripted_client.post("/v1/responses/compact",
                                    json={"model": "demo", "input": "Hi"})  # fmt: skip
    assert_error(response, 500, None, "server_error")
    assert response.json()["error"]["type"] == "server_error"


# -- context_management: compaction inside a response -----------------------------------------

REPLY = "<|channel|>final<|message|>Tomorrow: rain.<|return|>"
MANAGED = [{"type": "compaction", "compact_threshold": 60}]


def _tool_history(client: TestClient, engine: ScriptedEngine) -> list[dict[str, Any]]:
    """A finished tool loop, as a stateless client keeps it: items with assistant, call and
    output items worth compacting."""
    engine.queue(harmony_tokens(PREAMBLE_AND_CALL))
    first = _create(client, input="Weather in Oslo?", tools=TOOLS, store=False)
    call = first["output"][-1]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "12 C"}
    return [{"role": "user", "content": "Weather in Oslo?"}, *first["output"], output,
            {"role": "user", "content": "And tomorrow?"}]  # fmt: skip


def test_a_prompt_over_the_threshold_is_compacted_first(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    history = _tool_history(scripted_client, scripted_engine)
    scripted_engine.queue(harmony_tokens(SUMMARY_REPLY), harmony_tokens(REPLY))
    response = _create(scripted_client, input=history, tools=TOOLS, context_management=MANAGED)
    compaction, answer = response["output"]
    assert set(compaction) == {"type", "id", "encrypted_content"}
    assert compaction["type"] == "compaction" and compaction["id"].startswith("cmp_")
    assert unseal(compaction["encrypted_content"], COMPACTION_PREFIX) == SUMMARY
    assert answer["content"][0]["text"] == "Tomorrow: rain."
    summary_prompt, reply_prompt = (decode(p) for p in scripted_engine.prompts[-2:])
    assert "12 C" in summary_prompt and summary_prompt.endswith(
        f"{SUMMARY_REQUEST}<|end|><|start|>assistant"
    )
    # The reply's prompt: the tools, the user messages, the summary; nothing it replaced.
    assert "namespace functions" in reply_prompt
    assert "to=functions.get_weather" not in reply_prompt
    assert "Let me check." not in reply_prompt
    assert reply_prompt.endswith(
        "<|start|>user<|message|>Weather in Oslo?<|end|>"
        "<|start|>user<|message|>And tomorrow?<|end|>"
        f"<|start|>user<|message|>{COMPACTION_INTRO}{SUMMARY}<|end|><|start|>assistant"
    )
    assert response["usage"]["input_tokens"] == len(scripted_engine.prompts[-1])
    # Sent back whole (input += output), the history before the compaction stays out but for
    # the user messages; by previous_response_id the same.
    scripted_engine.queue(harmony_tokens(ANSWER))
    _create(scripted_client, input=[*history, *response["output"],
                                    {"role": "user", "content": "Thanks."}])  # fmt: skip
    sent_back = decode(scripted_engine.prompts[-1])
    assert "to=functions.get_weather" not in sent_back and "Tomorrow: rain." in sent_back
    assert sent_back.endswith(
        f"{SUMMARY}<|end|><|start|>assistant<|channel|>final<|message|>Tomorrow: rain.<|end|>"
        "<|start|>user<|message|>Thanks.<|end|><|start|>assistant"
    )
    scripted_engine.queue(harmony_tokens(ANSWER))
    _create(scripted_client, previous_response_id=response["id"], input="Thanks.")
    assert decode(scripted_engine.prompts[-1]) == sent_back


def test_a_prompt_under_the_threshold_is_not_compacted(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    history = _tool_history(scripted_client, scripted_engine)
    calls = len(scripted_engine.prompts)
    scripted_engine.queue(harmony_tokens(REPLY))
    response = _create(
        scripted_client,
        input=history,
        tools=TOOLS,
        context_management=[{"type": "compaction", "compact_threshold": 5000}],
    )
    assert [item["type"] for item in response["output"]] == ["message"]
    assert len(scripted_engine.prompts) == calls + 1  # no summary's generation
    assert "12 C" in decode(scripted_engine.prompts[-1])
    # Nor one of user messages alone: a summary would not shorten it.
    scripted_engine.queue(harmony_tokens(REPLY))
    _create(scripted_client, input="A question. " * 40, context_management=MANAGED)
    assert len(scripted_engine.prompts) == calls + 2


def test_a_compacting_response_streams_its_compaction_first(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    history = _tool_history(scripted_client, scripted_engine)
    scripted_engine.queue(harmony_tokens(SUMMARY_REPLY), harmony_tokens(REPLY))
    events, final = _stream_events(scripted_client, input=history, tools=TOOLS,
                                   context_management=MANAGED)  # fmt: skip
    for event in events:
        EVENT_TYPES[event["type"]].model_validate(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created, _, added, done, next_added = events[:5]
    assert created["response"]["output"] == []
    assert (added["type"], done["type"]) == ("response.output_item.added",
                                             "response.output_item.done")  # fmt: skip
    assert added["output_index"] == done["output_index"] == 0
    assert added["item"] == done["item"] == final["output"][0]
    assert next_added["output_index"] == 1 and final["output"][1]["type"] == "message"
    Response.model_validate(final)


def test_a_conversation_past_the_context_is_compacted_rather_than_refused() -> None:
    engine = ScriptedEngine()
    engine.info = EngineInfo("demo", 4000, 201088, created_at=1700000000)
    words = " ".join(["word"] * 600)
    history = []
    for n in range(8):
        history += [{"role": "user", "content": f"Question {n}?"},
                    {"role": "assistant", "content": f"Answer {n}: {words}"}]  # fmt: skip
    history.append({"role": "user", "content": "Last?"})
    with TestClient(create_app(engine, ResponseStore(":memory:"), ServerConfig())) as client:
        refused = client.post("/v1/responses", json={"model": "demo", "input": history})
        assert_error(refused, 400, "input", "context_length_exceeded")
        engine.queue(harmony_tokens(SUMMARY_REPLY), harmony_tokens(REPLY))
        managed = [{"type": "compaction"}]  # 80% of the context
        response = _create(client, input=history, context_management=managed)
    assert [item["type"] for item in response["output"]] == ["compaction", "message"]
    summary_prompt, reply_prompt = (decode(p) for p in engine.prompts[-2:])
    assert "Answer 0:" not in summary_prompt and "Answer 7:" in summary_prompt  # its room
    assert "Answer" not in reply_prompt and "Question 0?" in reply_prompt


def test_a_conversation_keeps_its_compaction(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    history = _tool_history(scripted_client, scripted_engine)
    created = scripted_client.post("/v1/conversations", json={"items": history[:-1]})
    conversation = created.json()["id"]
    scripted_engine.queue(harmony_tokens(SUMMARY_REPLY), harmony_tokens(REPLY))
    response = _create(scripted_client, conversation=conversation, input="And tomorrow?",
                       tools=TOOLS, context_management=MANAGED)  # fmt: skip
    items = scripted_client.get(f"/v1/conversations/{conversation}/items?order=asc&limit=100")
    listed = items.json()["data"]
    assert listed[-2:] == response["output"]
    scripted_engine.queue(harmony_tokens(ANSWER))
    _create(scripted_client, conversation=conversation, input="Thanks.")
    prompt = decode(scripted_engine.prompts[-1])
    assert "to=functions.get_weather" not in prompt and f"{COMPACTION_INTRO}{SUMMARY}" in prompt


def test_metrics_count_compactions_by_way(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    history = _tool_history(scripted_client, scripted_engine)
    scripted_engine.queue(harmony_tokens(SUMMARY_REPLY))
    _compact(scripted_client, input=history)
    scripted_engine.queue(harmony_tokens(SUMMARY_REPLY), harmony_tokens(REPLY))
    _create(scripted_client, input=history, tools=TOOLS, context_management=MANAGED)
    _create(scripted_client, input="Short.", context_management=MANAGED)  # nothing to leave out
    text = scripted_client.get("/metrics").text
    assert 'gptoss_compactions_total{way="compact"} 1.0' in text
    assert 'gptoss_compactions_total{way="managed"} 1.0' in text


def test_bad_context_management_is_a_400(scripted_client: TestClient) -> None:
    def post(entries: Any):
        body = {"model": "demo", "input": "Hi", "context_management": entries}
        return scripted_client.post("/v1/responses", json=body)

    assert_error(post([{"type": "truncate"}]), 400, "context_management[0].type")
    assert_error(post([{"type": "compaction", "compact_threshold": 0}]), 400,
                 "context_management[0].compact_threshold")  # fmt: skip
    assert_error(post([{"type": "compaction"}] * 2), 400, "context_management")
    assert_error(post([{"type": "compaction", "keep": 1}]), 400, "context_management[0].keep")


def _stream_events(client: TestClient, **body: Any) -> tuple[list[dict[str, Any]], dict]:
    payload = {"model": "demo", "stream": True, **body}
    with client.stream("POST", "/v1/responses", json=payload) as response:
        assert response.status_code == 200
        events = sse_events(response.read().decode())
    return events, events[-1]["response"]


def test_a_background_response_compacts_before_it_is_queued() -> None:
    with scripted_server(REPLY) as (_, client, engine):
        engine.queue(harmony_tokens(PREAMBLE_AND_CALL))
        first = client.responses.create(model="demo", input="Weather?", tools=TOOLS)
        call = first.output[-1]
        engine.queue(harmony_tokens(SUMMARY_REPLY), harmony_tokens(REPLY))
        created = client.responses.create(
            model="demo", previous_response_id=first.id, tools=TOOLS, background=True,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}],
            extra_body={"context_management": MANAGED},
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while (done := client.responses.retrieve(created.id)).status != "completed":
            assert time.monotonic() < deadline, done.status
            time.sleep(0.02)
    assert [item.type for item in done.output] == ["compaction", "message"]
    assert unseal(done.output[0].encrypted_content, COMPACTION_PREFIX) == SUMMARY


def test_a_compaction_trigger_compacts_whatever_the_size(
    scripted_client: TestClient, scripted_engine: ScriptedEngine
) -> None:
    """The SDK's ``compaction_trigger``, the last input item: the response compacts first,
    however short its prompt, then answers; the trigger is no item of the conversation."""
    history = _tool_history(scripted_client, scripted_engine)
    scripted_engine.queue(harmony_tokens(SUMMARY_REPLY), harmony_tokens(REPLY))
    response = _create(scripted_client, input=[*history, {"type": "compaction_trigger"}],
                       tools=TOOLS)  # fmt: skip
    assert [item["type"] for item in response["output"]] == ["compaction", "message"]
    assert decode(scripted_engine.prompts[-1]).endswith(
        f"<|start|>user<|message|>{COMPACTION_INTRO}{SUMMARY}<|end|><|start|>assistant"
    )
    listed = scripted_client.get(f"/v1/responses/{response['id']}/input_items?limit=100")
    assert "compaction_trigger" not in {item["type"] for item in listed.json()["data"]}
    # Nothing a summary could leave out: it answers at once.
    calls = len(scripted_engine.prompts)
    scripted_engine.queue(harmony_tokens(REPLY))
    _create(scripted_client, input=[{"role": "user", "content": "Hi"},
                                    {"type": "compaction_trigger", "id": "ct_1"}])  # fmt: skip
    assert len(scripted_engine.prompts) == calls + 1


def test_a_compaction_trigger_goes_last_and_in_a_response(scripted_client: TestClient) -> None:
    trigger = {"type": "compaction_trigger"}
    early = scripted_client.post("/v1/responses", json={
        "model": "demo", "input": [trigger, {"role": "user", "content": "Hi"}]})  # fmt: skip
    assert_error(early, 400, "input[0]")
    conversation = scripted_client.post("/v1/conversations", json={"items": [trigger]})
    assert_error(conversation, 400, "items[0].type")
