"""The Conversations API (``/v1/conversations``) and responses created with ``conversation``.

The official SDK against a real server on loopback over a scripted engine: every object is
validated against the SDK's own types, and the prompts the engine got show what the model saw.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.conversations import Conversation, ConversationItem, ConversationItemList
from openai.types.responses import Response
from pydantic import TypeAdapter

from gptoss_serve.harmony.adapter import decode
from gptoss_serve.server.conversation_locks import ConversationLocks
from gptoss_serve.server.errors import APIError
from gptoss_serve.server.reasoning_seal import seal, unseal
from server_helpers import TOOLS, ScriptedEngine, harmony_tokens, scripted_server

REPLY = (
    "<|channel|>analysis<|message|>Thinking.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Need weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>'
)
LONG = "<|channel|>analysis<|message|>" + "word " * 400  # ~4 s at 10 ms a token
ITEM: TypeAdapter = TypeAdapter(ConversationItem)


@pytest.fixture()
def served() -> Iterator[tuple[str, openai.OpenAI, ScriptedEngine]]:
    with scripted_server(REPLY) as serving:
        yield serving


def _items(client: openai.OpenAI, conversation_id: str, **query: Any) -> list[dict[str, Any]]:
    """Every item, through the SDK's own pagination, each validated against its type."""
    page = client.conversations.items.list(conversation_id, **query)
    return [ITEM.validate_python(item.model_dump(mode="json")).model_dump() for item in page]


def _valid(response: Response) -> Response:
    return Response.model_validate(response.model_dump(mode="json"))


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_conversation_carries_the_turns_and_takes_each_response_items(served) -> None:
    _, client, engine = served
    conversation = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
        metadata={"topic": "names"},
    )
    Conversation.model_validate(conversation.model_dump(mode="json"))
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "names"}

    first = _valid(client.responses.create(model="demo", conversation=conversation.id,
                                           input="What is my name?"))  # fmt: skip
    assert first.conversation is not None and first.conversation.id == conversation.id
    prompt = decode(engine.prompts[-1])
    assert prompt.index("My name is Ada.") < prompt.index("What is my name?")

    items = _items(client, conversation.id, order="asc")
    assert [(item["type"], item.get("role")) for item in items] == [
        ("message", "user"), ("message", "user"), ("reasoning", None), ("message", "assistant"),
    ]  # fmt: skip
    assert [item["id"] for item in items[2:]] == [item.id for item in first.output]
    assert items[3]["content"][0]["text"] == "Hello!"

    second = _valid(client.responses.create(model="demo", conversation={"id": conversation.id},
                                            input="And again?"))  # fmt: skip
    prompt = decode(engine.prompts[-1])
    for text in ("My name is Ada.", "What is my name?", "Hello!", "And again?"):
        assert text in prompt
    assert "Thinking." not in prompt  # the finished turn's analysis is dropped (Harmony's rule)
    assert second.previous_response_id is None
    assert len(_items(client, conversation.id)) == 7
    newest_first = _items(client, conversation.id)
    assert [item["id"] for item in newest_first[:2]] == [item.id for item in second.output][::-1]


def test_items_are_paged_added_read_and_deleted(served) -> None:
    url, client, _ = served
    conversation = client.conversations.create()
    texts = [f"note {n}" for n in range(25)]
    for start in (0, 20):
        added = client.conversations.items.create(
            conversation.id,
            items=[{"role": "user", "content": text} for text in texts[start : start + 20]],
        )
        ConversationItemList.model_validate(added.model_dump(mode="json"))
        assert added.first_id == added.data[0].id and not added.has_more
    ascending = _items(client, conversation.id, order="asc", limit=7)  # 4 pages
    assert [item["content"][0]["text"] for item in ascending] == texts
    assert [item["id"] for item in _items(client, conversation.id, limit=10)] == [
        item["id"] for item in ascending[::-1]
    ]
    page = httpx.get(f"{url}/v1/conversations/{conversation.id}/items",
                     params={"limit": 3, "after": ascending[10]["id"]}).json()  # fmt: skip
    assert [item["content"][0]["text"] for item in page["data"]] == ["note 9", "note 8", "note 7"]
    assert page["has_more"] and page["last_id"] == ascending[7]["id"]

    one = client.conversations.items.retrieve(ascending[3]["id"], conversation_id=conversation.id)
    assert one.id == ascending[3]["id"]
    after_delete = client.conversations.items.delete(ascending[3]["id"],
                                                     conversation_id=conversation.id)  # fmt: skip
    assert after_delete.id == conversation.id
    assert len(_items(client, conversation.id)) == 24
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(ascending[3]["id"], conversation_id=conversation.id)

    updated = client.conversations.update(conversation.id, metadata={"k": "v"})
    assert client.conversations.retrieve(conversation.id).metadata == {"k": "v"} == updated.metadata
    deleted = client.conversations.delete(conversation.id)
    assert deleted.deleted and deleted.object == "conversation.deleted"
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    _error(httpx.get(f"{url}/v1/conversations/{conversation.id}/items"), 404)


def test_a_tool_loop_over_a_conversation(served) -> None:
    _, client, engine = served
    conversation = client.conversations.create()
    engine.queue(harmony_tokens(CALL), harmony_tokens(REPLY))
    call = client.responses.create(model="demo", conversation=conversation.id, tools=TOOLS,
                                   input="Weather in Oslo?")  # fmt: skip
    function_call = call.output[-1]
    assert function_call.type == "function_call"
    # The call is in the conversation: its output alone continues it.
    answer = client.responses.create(
        model="demo", conversation=conversation.id, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": function_call.call_id,
                "output": '{"temp": 3}'}],
    )  # fmt: skip
    assert answer.status == "completed"
    prompt = decode(engine.prompts[-1])
    assert "functions.get_weather" in prompt and '{"temp": 3}' in prompt
    assert "Need weather." in prompt  # a tool loop in progress keeps its analysis
    types = [item["type"] for item in _items(client, conversation.id, order="asc")]
    assert types == ["message", "reasoning", "function_call", "function_call_output",
                     "reasoning", "message"]  # fmt: skip


def test_an_item_reference_finds_a_conversation_item(served) -> None:
    _, client, engine = served
    conversation = client.conversations.create(
        items=[{"role": "user", "content": "Remember the number 41."}]
    )
    item_id = _items(client, conversation.id)[0]["id"]
    client.responses.create(model="demo", input=[{"type": "item_reference", "id": item_id}])
    assert "Remember the number 41." in decode(engine.prompts[-1])


def test_bad_requests_name_the_field(served) -> None:
    url, client, _ = served
    conversation = client.conversations.create(items=[{"role": "user", "content": "Hi"}])
    responses = f"{url}/v1/responses"
    body = {"model": "demo", "input": "Hi"}

    error = _error(httpx.post(responses, json={**body, "conversation": "conv_nope"}), 404)
    assert error["param"] == "conversation" and "conv_nope" in error["message"]
    first = client.responses.create(model="demo", input="Hi")
    both = {**body, "conversation": conversation.id, "previous_response_id": first.id}
    assert _error(httpx.post(responses, json=both), 400)["param"] == "conversation"
    assert _error(httpx.post(responses, json={**body, "conversation": ""}), 400)["param"]
    assert _error(httpx.post(responses, json={**body, "conversation": {"id": 3}}), 400)["param"]

    held = _items(client, conversation.id)[0]["id"]
    repeated = [{"type": "message", "id": held, "role": "user", "content": "Hi"}]
    again = {**body, "conversation": conversation.id, "input": repeated}
    error = _error(httpx.post(responses, json=again), 400)
    assert error["param"] == "input[0]" and held in error["message"]
    output = [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]
    orphan = {**body, "conversation": conversation.id, "input": output}
    assert _error(httpx.post(responses, json=orphan), 400)["param"] == "input[0].call_id"
    assert len(_items(client, conversation.id)) == 1  # nothing refused was added

    items_url = f"{url}/v1/conversations/{conversation.id}/items"
    many = [{"role": "user", "content": str(n)} for n in range(21)]
    assert _error(httpx.post(items_url, json={"items": many}), 400)["param"] == "items"
    assert _error(httpx.post(items_url, json={"items": []}), 400)["param"] == "items"
    twice = [{"type": "message", "id": "msg_a", "role": "user", "content": "x"}] * 2
    assert _error(httpx.post(items_url, json={"items": twice}), 400)["param"] == "items[1]"
    bad_include = httpx.get(items_url, params={"include": "file_search_call.results"})
    assert _error(bad_include, 400)["param"] == "include[0]"
    assert _error(httpx.get(items_url, params={"after": "msg_nope"}), 404)["param"] == "after"
    assert _error(httpx.get(items_url, params={"limit": 0}), 400)["param"] == "limit"
    create = f"{url}/v1/conversations"
    assert _error(httpx.post(create, json={"metadata": {"k": "v" * 513}}), 400)["param"]
    assert _error(httpx.post(create, json={"items": "Hi"}), 400)["param"] == "items"
    update = f"{url}/v1/conversations/{conversation.id}"
    assert _error(httpx.post(update, json={}), 400)["param"] == "metadata"
    assert _error(httpx.post(f"{url}/v1/conversations/conv_nope", json={"metadata": {}}), 404)
    assert _error(httpx.delete(f"{url}/v1/conversations/conv_nope"), 404)
    assert _error(httpx.delete(f"{items_url}/msg_nope"), 404)["param"] == "item_id"
    assert len(_items(client, conversation.id)) == 1


def test_one_response_at_a_time_per_conversation() -> None:
    with scripted_server(REPLY) as (url, client, engine):
        engine.queue(harmony_tokens(LONG), harmony_tokens(REPLY), harmony_tokens(REPLY))
        engine.delay = 0.01
        conversation = client.conversations.create()
        running = client.responses.create(model="demo", conversation=conversation.id,
                                          input="Go on.", background=True)  # fmt: skip
        body = {"model": "demo", "input": "Me too", "conversation": conversation.id}
        error = _error(httpx.post(f"{url}/v1/responses", json=body), 400)
        assert error["code"] == "conversation_locked" and error["param"] == "conversation"
        add = httpx.post(f"{url}/v1/conversations/{conversation.id}/items",
                         json={"items": [{"role": "user", "content": "x"}]})  # fmt: skip
        assert _error(add, 400)["code"] == "conversation_locked"
        other = client.conversations.create()  # other conversations are free
        assert client.responses.create(model="demo", conversation=other.id, input="Hi").output

        cancelled = client.responses.cancel(running.id)
        assert cancelled.status == "cancelled"
        assert _items(client, conversation.id) == []  # a cancelled turn adds nothing
        engine.delay = 0.0
        after = client.responses.create(model="demo", conversation=conversation.id, input="Hi")
        assert after.status == "completed"
        assert len(_items(client, conversation.id)) == 3


def test_failed_turns_add_nothing_and_cut_turns_are_kept(served) -> None:
    _, client, engine = served
    conversation = client.conversations.create()
    engine.queue([*harmony_tokens("<|channel|>analysis<|message|>Hm"), RuntimeError("GPU gone")])
    failed = client.responses.create(model="demo", conversation=conversation.id, input="Hi")
    assert failed.status == "failed"
    assert _items(client, conversation.id) == []
    engine.queue(harmony_tokens(LONG))
    cut = client.responses.create(model="demo", conversation=conversation.id, input="Hi",
                                  max_output_tokens=16)  # fmt: skip
    assert cut.status == "incomplete"
    kept = _items(client, conversation.id, order="asc")
    assert [item["type"] for item in kept] == ["message", "reasoning"]
    assert kept[1]["status"] == "incomplete"


def test_streamed_and_unstored_responses_add_their_items(served) -> None:
    url, client, engine = served
    conversation = client.conversations.create()
    with client.responses.stream(model="demo", conversation=conversation.id,
                                 input="Hi") as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    assert events[0].response.conversation.id == conversation.id
    assert [item.id for item in final.output] == [
        item["id"] for item in _items(client, conversation.id, order="asc")[1:]
    ]
    unstored = client.responses.create(model="demo", conversation=conversation.id,
                                       input="Once more", store=False)  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert len(_items(client, conversation.id)) == 6
    count_url = f"{url}/v1/responses/input_tokens"
    counted = httpx.post(count_url, json={"conversation": conversation.id, "input": "Next"}).json()
    alone = httpx.post(count_url, json={"input": "Next"}).json()
    assert counted["input_tokens"] > alone["input_tokens"]
    assert "Once more" in decode(engine.prompts[-1])


def test_include_shows_sealed_reasoning_and_logprobs_only_when_asked(served) -> None:
    url, client, _ = served
    conversation = client.conversations.create()
    client.responses.create(model="demo", conversation=conversation.id, input="Hi",
                            include=["message.output_text.logprobs"], top_logprobs=2)  # fmt: skip
    items_url = f"{url}/v1/conversations/{conversation.id}/items"
    plain = httpx.get(items_url, params={"order": "asc"}).json()["data"]
    assert plain[1]["encrypted_content"] is None
    assert plain[2]["content"][0]["logprobs"] == []
    wanted = {"order": "asc", "include": ["reasoning.encrypted_content",
                                          "message.output_text.logprobs"]}  # fmt: skip
    shown = httpx.get(items_url, params=wanted).json()["data"]
    assert unseal(shown[1]["encrypted_content"]) == "Thinking."
    assert shown[2]["content"][0]["logprobs"]  # one entry a token of "Hello!"


def test_conversations_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    with scripted_server(REPLY, path) as (_, client, _):
        conversation = client.conversations.create(metadata={"a": "b"})
        client.responses.create(model="demo", conversation=conversation.id, input="Hi")
    with scripted_server(REPLY, path) as (_, client, engine):
        assert client.conversations.retrieve(conversation.id).metadata == {"a": "b"}
        client.responses.create(model="demo", conversation=conversation.id, input="Again")
        assert "Hello!" in decode(engine.prompts[-1])
        assert len(_items(client, conversation.id)) == 6


def test_a_lease_dropped_unreleased_frees_its_conversation() -> None:
    locks = ConversationLocks()
    lease = locks.acquire("conv_1")
    with pytest.raises(APIError) as refused:
        locks.acquire("conv_1")
    assert refused.value.status_code == 400
    del lease  # a response dropped before it ran (a stream whose client left at once)
    locks.acquire("conv_1").release()
    locks.check("conv_1")


def test_a_reasoning_item_sent_sealed_is_listed_sealed_only_when_asked(served) -> None:
    url, client, _ = served
    sealed = {"type": "reasoning", "summary": [], "encrypted_content": seal("Earlier thought.")}
    conversation = client.conversations.create(
        items=[{"role": "user", "content": "Hi"}, sealed, {"role": "assistant", "content": "Yo"}]
    )
    items_url = f"{url}/v1/conversations/{conversation.id}/items"
    plain = httpx.get(items_url, params={"order": "asc"}).json()["data"]
    assert plain[1]["type"] == "reasoning" and plain[1]["encrypted_content"] is None
    wanted = {"order": "asc", "include": "reasoning.encrypted_content"}
    shown = httpx.get(items_url, params=wanted).json()["data"]
    assert unseal(shown[1]["encrypted_content"]) == "Earlier thought."
