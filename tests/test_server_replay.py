"""A tool loop's next prompt continues the tokens the model generated (harmony/replay.py),
whichever way the client sends its messages back: previous_response_id, the items themselves
(as the Agents SDK does), a conversation, or Chat Completions messages."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gptoss_serve.config import ServerConfig
from gptoss_serve.harmony.adapter import decode
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import (
    CHAT_TOOLS,
    PREAMBLE_AND_CALL,
    REASONING_THEN_FINAL,
    TOOLS,
    ScriptedEngine,
    harmony_tokens,
    running_server,
)

# The reasoning in other tokens than its text's canonical encoding (as a sampled model may
# write it), then a preamble and the call with the recipient after the channel.
CALL_SCRIPT = [
    *harmony_tokens("<|channel|>analysis<|message|>Need wea"),
    *harmony_tokens("ther."),
    *harmony_tokens(PREAMBLE_AND_CALL.removeprefix("<|channel|>analysis<|message|>Need weather.")),
]
SECOND_CALL = harmony_tokens(
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
    '{"city": "Bergen"}<|call|>'
)  # fmt: skip
ASK = "Weather in Oslo?"


def serve(config: ServerConfig) -> Iterator[tuple[str, openai.OpenAI, ScriptedEngine]]:
    engine = ScriptedEngine()
    engine.last_script = harmony_tokens(REASONING_THEN_FINAL)
    with running_server(create_app(engine, ResponseStore(":memory:"), config)) as url:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), engine


@pytest.fixture()
def served() -> Iterator[tuple[str, openai.OpenAI, ScriptedEngine]]:
    yield from serve(ServerConfig())


def continues(engine: ScriptedEngine, turn: int, generated: list[int]) -> bool:
    """Whether prompt ``turn`` starts with prompt ``turn - 1`` and what was generated."""
    before = engine.prompts[turn - 1] + generated
    return engine.prompts[turn][: len(before)] == before


def output_of(call: object) -> dict:
    return {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}


def test_a_chained_tool_loop_continues_what_was_generated(served) -> None:
    url, client, engine = served
    engine.queue(CALL_SCRIPT, SECOND_CALL, harmony_tokens(REASONING_THEN_FINAL))
    first = client.responses.create(model="demo", input=ASK, tools=TOOLS)
    call = first.output[-1]
    second = client.responses.create(model="demo", previous_response_id=first.id, tools=TOOLS,
                                     input=[output_of(call)])  # fmt: skip
    assert continues(engine, 1, CALL_SCRIPT)
    assert second.usage.input_tokens == len(engine.prompts[1])
    count = httpx.post(f"{url}/v1/responses/input_tokens", json={
        "model": "demo", "previous_response_id": first.id, "tools": TOOLS,
        "input": [output_of(call)],
    })  # fmt: skip
    assert count.json()["input_tokens"] == len(engine.prompts[1])
    client.responses.create(model="demo", previous_response_id=second.id, tools=TOOLS,
                            input=[output_of(second.output[-1])])  # fmt: skip
    assert continues(engine, 2, SECOND_CALL)


def test_metrics_count_what_is_kept_and_replayed(served) -> None:
    url, client, engine = served
    engine.queue(CALL_SCRIPT, SECOND_CALL)
    first = client.responses.create(model="demo", input=ASK, tools=TOOLS)
    client.responses.create(model="demo", previous_response_id=first.id, tools=TOOLS,
                            input=[output_of(first.output[-1])])  # fmt: skip
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
        for sample in family.samples
    }
    # Kept: the first turn's reasoning (other tokens than its text's) and call, the second
    # turn's call; its preamble rendered as it was generated. Replayed: the first two.
    assert samples["gptoss_replay_cache_messages"] == 3
    assert samples["gptoss_replayed_messages_total"] == 2
    kept = len(CALL_SCRIPT) - len(harmony_tokens(
        "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
    )) + 2 + len(SECOND_CALL) + 2  # fmt: skip
    assert samples["gptoss_replay_cache_tokens"] == kept


def test_items_sent_back_get_the_same_prompt_as_a_chain(served) -> None:
    _, client, engine = served
    engine.queue(CALL_SCRIPT, harmony_tokens(REASONING_THEN_FINAL))
    first = client.responses.create(model="demo", input=ASK, tools=TOOLS)
    items = [{"role": "user", "content": ASK},
             *(item.model_dump(exclude_none=True) for item in first.output),
             output_of(first.output[-1])]  # fmt: skip
    client.responses.create(model="demo", input=items, tools=TOOLS)
    assert continues(engine, 1, CALL_SCRIPT)


def test_a_conversation_continues_what_was_generated(served) -> None:
    _, client, engine = served
    engine.queue(CALL_SCRIPT, harmony_tokens(REASONING_THEN_FINAL))
    conversation = client.conversations.create()
    first = client.responses.create(model="demo", input=ASK, tools=TOOLS,
                                    conversation=conversation.id)  # fmt: skip
    client.responses.create(model="demo", input=[output_of(first.output[-1])], tools=TOOLS,
                            conversation=conversation.id)  # fmt: skip
    assert continues(engine, 1, CALL_SCRIPT)


def test_loops_making_the_same_call_each_continue_their_own(served) -> None:
    """Two interleaved loops make the same call in other tokens (as sampled models may): each
    turn continues its own loop's tokens (with the call's text alone as the key, the second
    loop's spelling went into the first's prompt, whose KV blocks then served neither)."""
    _, client, engine = served
    spelled = [*CALL_SCRIPT[: -len(harmony_tokens('Oslo"}<|call|>'))],
               *harmony_tokens("O"), *harmony_tokens('slo"}<|call|>')]  # fmt: skip
    assert decode(spelled) == decode(CALL_SCRIPT) and spelled != CALL_SCRIPT
    scripts = [CALL_SCRIPT, spelled, SECOND_CALL, SECOND_CALL, SECOND_CALL, SECOND_CALL]
    engine.queue(*scripts)
    asks = [ASK, "Weather in Oslo, please?"]
    loops = [client.responses.create(model="demo", input=ask, tools=TOOLS) for ask in asks]
    for _ in range(2):
        for number, response in enumerate(loops):
            loops[number] = client.responses.create(
                model="demo", previous_response_id=response.id, tools=TOOLS,
                input=[output_of(response.output[-1])],
            )  # fmt: skip
    for index in range(2, 6):  # the prompt of each loop's next turn
        before = engine.prompts[index - 2] + scripts[index - 2]
        assert engine.prompts[index][: len(before)] == before, index


def test_an_answer_comes_back_as_generated_with_the_history_terminator(served) -> None:
    """The next turn drops the reasoning (Harmony's rule); the answer the model ended with
    <|return|> is its generated tokens ending in <|end|>."""
    _, client, engine = served
    answer = [*harmony_tokens("<|channel|>final<|message|>Hel"), *harmony_tokens("lo!<|return|>")]
    engine.queue(answer)
    first = client.responses.create(model="demo", input="Hi")
    client.responses.create(model="demo", previous_response_id=first.id, input="Again")
    replayed = harmony_tokens("<|start|>assistant") + answer[:-1] + harmony_tokens("<|end|>")
    prompt = engine.prompts[1]
    assert any(prompt[i : i + len(replayed)] == replayed for i in range(len(prompt)))


def test_an_answer_after_reasoning_is_not_kept(served) -> None:
    """The next turn drops the reasoning (Harmony's rule), so what came after it never
    recurs: keeping it would only push out what does."""
    url, client, engine = served
    answer = [
        *harmony_tokens(
            "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant"
            "<|channel|>final<|message|>Hel"
        ),
        *harmony_tokens("lo!<|return|>"),
    ]
    engine.queue(answer)
    client.responses.create(model="demo", input="Hi")
    metrics = httpx.get(f"{url}/metrics").text
    assert "gptoss_replay_cache_messages 0.0" in metrics


def test_a_changed_call_and_a_server_without_replays_render_as_harmony_does() -> None:
    for config in (ServerConfig(replay_cache_tokens=0), ServerConfig()):
        for _, client, engine in serve(config):
            engine.queue(CALL_SCRIPT, harmony_tokens(REASONING_THEN_FINAL))
            first = client.responses.create(model="demo", input=ASK, tools=TOOLS)
            call = first.output[-1].model_dump(exclude_none=True)
            if config.replay_cache_tokens:  # the client edits the call it sends back
                call["arguments"] = '{"city": "Bergen"}'
            items = [{"role": "user", "content": ASK}, call, output_of(first.output[-1])]
            client.responses.create(model="demo", input=items, tools=TOOLS)
            assert "<|start|>assistant to=functions.get_weather<|channel|>commentary" in (
                decode(engine.prompts[1])
            )


def test_a_chat_message_sent_back_as_the_sdk_returned_it(served) -> None:
    """``messages.append(completion.choices[0].message)``: its ``annotations`` and nulls are
    taken, its content before the calls is the preamble it was, and the prompt continues what
    was generated."""
    _, client, engine = served
    engine.queue(CALL_SCRIPT, harmony_tokens(REASONING_THEN_FINAL))
    messages: list = [{"role": "user", "content": ASK}]
    completion = client.chat.completions.create(model="demo", messages=messages,
                                                tools=CHAT_TOOLS)  # fmt: skip
    message = completion.choices[0].message
    assert message.annotations == [] and message.content == "Let me check."
    messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                           "content": "sunny"}]  # fmt: skip
    answer = client.chat.completions.create(model="demo", messages=messages, tools=CHAT_TOOLS)
    assert answer.choices[0].finish_reason == "stop"
    assert continues(engine, 1, CALL_SCRIPT)
