"""``POST /v1/chat/completions`` through the official SDK against a real server on loopback: a
scripted engine for exact outputs, the demo model for a real generation. Every object and
chunk is validated against the SDK's own types."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.cpu_engine import CpuEngine
from gptoss_serve.harmony.adapter import decode
from gptoss_serve.model import load_model
from gptoss_serve.server.app import create_app
from gptoss_serve.server.chat_routes import SEED_RANGE
from gptoss_serve.server.store import ResponseStore
from server_helpers import (
    CHAT_TOOLS,
    PREAMBLE_AND_CALL,
    REASONING_THEN_FINAL,
    ScriptedEngine,
    harmony_tokens,
    running_server,
    scripted_server,
)

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture()
def served() -> Iterator[tuple[str, openai.OpenAI, ScriptedEngine]]:
    with scripted_server(REASONING_THEN_FINAL) as serving:
        yield serving


def _valid(completion: ChatCompletion) -> ChatCompletion:
    return ChatCompletion.model_validate(completion.model_dump(mode="json"))


def _error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_completion_carries_the_answer_the_reasoning_and_the_usage(served) -> None:
    _, client, engine = served
    messages = [{"role": "system", "content": "Be brief."}, *HI]
    completion = _valid(client.chat.completions.create(model="demo", messages=messages))
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert choice.message.content == "Hello there, friend! 👋"
    assert choice.message.tool_calls is None and choice.logprobs is None
    assert choice.message.model_extra["reasoning_content"] == "The user greets. Reply."
    usage = completion.usage
    assert usage.completion_tokens == len(harmony_tokens(REASONING_THEN_FINAL))
    assert usage.prompt_tokens == len(engine.prompts[-1])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.completion_tokens_details.reasoning_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens == 0
    prompt = decode(engine.prompts[-1])
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in prompt


def test_a_stream_is_chunks_then_done(served) -> None:
    url, client, _ = served
    chunks = list(client.chat.completions.create(
        model="demo", messages=HI, stream=True, stream_options={"include_usage": True}
    ))  # fmt: skip
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump(mode="json"))
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(d.content or "" for d in deltas) == "Hello there, friend! 👋"
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == "The user greets. Reply."
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    body = {"model": "demo", "messages": HI, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert "usage" not in json.loads(lines[-2][6:])  # include_usage not asked for

    with client.chat.completions.stream(model="demo", messages=HI) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "Hello there, friend! 👋"


def test_tool_calls_and_the_tool_loop(served) -> None:
    _, client, engine = served
    call_script, reply = harmony_tokens(PREAMBLE_AND_CALL), harmony_tokens(REASONING_THEN_FINAL)
    engine.queue(call_script, call_script, reply)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    completion = _valid(client.chat.completions.create(model="demo", messages=ask,
                                                       tools=CHAT_TOOLS))  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Oslo"
    }
    with client.chat.completions.stream(model="demo", messages=ask, tools=CHAT_TOOLS) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.tool_calls[0].function.arguments == call.function.arguments
    follow = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()],
         "reasoning_content": "Need weather."},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'},
    ]  # fmt: skip
    answer = _valid(client.chat.completions.create(model="demo", messages=follow,
                                                   tools=CHAT_TOOLS))  # fmt: skip
    assert answer.choices[0].finish_reason == "stop"
    prompt = decode(engine.prompts[-1])
    assert "Need weather." in prompt  # the tool loop's reasoning stays (Harmony's rule)
    assert "to=functions.get_weather" in prompt and '{"temp": 3}' in prompt


def test_formats_and_tool_choices_are_enforced_by_grammar(served) -> None:
    _, client, engine = served
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    client.chat.completions.create(model="demo", messages=HI, response_format={
        "type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}
    })  # fmt: skip
    assert engine.params[-1].grammar is not None and '"city"' in engine.params[-1].grammar
    assert "# Response Formats\n\n## place" in decode(engine.prompts[-1])
    client.chat.completions.create(model="demo", messages=HI, tools=CHAT_TOOLS,
                                   tool_choice={"type": "function",
                                                "function": {"name": "get_weather"}})  # fmt: skip
    grammar = engine.params[-1].grammar
    assert "answer: call" in grammar and "get_weather" in grammar  # that call, nothing else


def test_sampling_fields_reach_the_engine(served) -> None:
    _, client, engine = served
    completion = _valid(client.chat.completions.create(
        model="demo", messages=HI, max_tokens=3, temperature=0.5, top_p=0.9, seed=2**63 - 1,
        logprobs=True, top_logprobs=2,
    ))  # fmt: skip
    params = engine.params[-1]
    assert params.max_tokens == 3 and params.temperature == 0.5 and params.top_p == 0.9
    assert params.seed == (2**63 - 1) % SEED_RANGE and params.logprobs == 2
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 3
    client.chat.completions.create(model="demo", messages=HI, max_completion_tokens=5)
    assert engine.params[-1].max_tokens == 5
    client.chat.completions.create(model="demo", messages=HI, reasoning_effort="high")
    assert "Reasoning: high" in decode(engine.prompts[-1])
    answer = _valid(client.chat.completions.create(model="demo", messages=HI, logprobs=True,
                                                   top_logprobs=1))  # fmt: skip
    entries = answer.choices[0].logprobs.content  # the emoji's bytes span two tokens
    assert bytes(b for entry in entries for b in entry.bytes).decode() == "Hello there, friend! 👋"
    assert all(len(entry.top_logprobs) == 1 for entry in entries)
    chunks = list(client.chat.completions.create(model="demo", messages=HI, stream=True,
                                                 logprobs=True))  # fmt: skip
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [entry.token for entry in streamed] == [entry.token for entry in entries]
    # Streamed too, each token's bytes exactly (the emoji's first token has U+FFFD as text).
    assert "\ufffd" in streamed[-2].token
    assert [entry.bytes for entry in streamed] == [entry.bytes for entry in entries]


def test_n_choices_each_a_generation_of_their_own(served) -> None:
    url, client, engine = served
    num_requests, full = len(engine.prompts), len(harmony_tokens(REASONING_THEN_FINAL))
    completion = _valid(client.chat.completions.create(model="demo", messages=HI, n=3, seed=5))
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    for choice in completion.choices:
        assert choice.message.content == "Hello there, friend! 👋"
        assert choice.message.model_extra["reasoning_content"] == "The user greets. Reply."
    prompts, params = engine.prompts[num_requests:], engine.params[num_requests:]
    assert len(prompts) == 3 and prompts[0] == prompts[1] == prompts[2]
    assert [p.seed for p in params] == [5, 6, 7]  # the set repeats; the choices differ
    usage = completion.usage  # the prompt once, every choice's output
    assert usage.prompt_tokens == len(prompts[0]) and usage.completion_tokens == 3 * full
    assert usage.total_tokens == usage.prompt_tokens + 3 * full
    client.chat.completions.create(model="demo", messages=HI, n=2)
    assert [p.seed for p in engine.params[-2:]] == [None, None]

    chunks = list(client.chat.completions.create(
        model="demo", messages=HI, n=2, stream=True, stream_options={"include_usage": True}
    ))  # fmt: skip
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump(mode="json"))
    assert len({chunk.id for chunk in chunks}) == 1
    for index in (0, 1):
        mine = [chunk.choices[0] for chunk in chunks if chunk.choices
                and chunk.choices[0].index == index]  # fmt: skip
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "stop"
        assert "".join(c.delta.content or "" for c in mine) == "Hello there, friend! 👋"
    assert [chunk for chunk in chunks if chunk.usage] == [chunks[-1]]
    assert chunks[-1].usage.completion_tokens == 2 * full
    with client.chat.completions.stream(model="demo", messages=HI, n=2, stop=",") as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert [choice.message.content for choice in final.choices] == ["Hello there"] * 2

    engine.queue(
        harmony_tokens(REASONING_THEN_FINAL),
        [*harmony_tokens("<|channel|>analysis<|message|>Hm"), RuntimeError("GPU gone")],
    )
    engine.delay = 0.01  # the first choice still runs when the second fails
    num_aborted = len(engine.aborted)
    error = _error(httpx.post(f"{url}/v1/chat/completions",
                              json={"model": "demo", "messages": HI, "n": 2}), 500)  # fmt: skip
    assert "GPU gone" in error["message"]
    assert len(engine.aborted) - num_aborted == 2  # the failed one and the one it stopped


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_stops_every_choice(served, stream: bool) -> None:
    url, _, engine = served
    engine.last_script = harmony_tokens("<|channel|>analysis<|message|>" + "word " * 400)
    engine.delay = 0.01  # ~4 s of tokens a choice
    body = {"model": "demo", "messages": HI, "n": 3, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            for count, _ in enumerate(response.iter_lines()):
                if count > 20:
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=0.3)
    for _ in range(100):  # 2 s: well before the scripts' end
        if len(engine.aborted) == 3:
            break
        time.sleep(0.02)
    assert len(engine.aborted) == 3


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"store": True}, "store"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "Hi", "name": "ann"}]}, "messages[0].name"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0].type"),
        ({"messages": [*HI, {"role": "tool", "tool_call_id": "nope", "content": "x"}]},
         "messages[1].tool_call_id"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
         "tools[0].function.parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"functions": []}, "functions"),
        ({"messages": [*HI, {"role": "assistant", "content": "x", "audio": {"id": "a"}}]},
         "messages[1].audio"),
        ({"messages": [*HI, {"role": "assistant", "content": "x",
                             "function_call": {"name": "f", "arguments": "{}"}}]},
         "messages[1].function_call"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_chat_field(served, fields: dict[str, Any], param: str) -> None:
    url, _, _ = served
    body = {"model": "demo", "messages": HI, **fields}
    error = _error(httpx.post(f"{url}/v1/chat/completions", json=body))
    assert error["param"] == param, error


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_end_the_answer_before_them(served, stream: bool) -> None:
    _, client, engine = served
    full = len(harmony_tokens(REASONING_THEN_FINAL))
    cases = {",": "Hello there", "e, f": "Hello ther", "friend! 👋x": "Hello there, friend! 👋"}
    for stop, expected in cases.items():
        num_aborted = len(engine.aborted)
        kwargs = {"model": "demo", "messages": HI, "stop": [stop, "never"]}
        if stream:
            chunks = list(client.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            ))  # fmt: skip
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            used = chunks[-1].usage.completion_tokens
        else:
            answer = _valid(client.chat.completions.create(**kwargs))
            text, finish = answer.choices[0].message.content, answer.choices[0].finish_reason
            used = answer.usage.completion_tokens
        assert (text, finish) == (expected, "stop"), stop
        stopped = expected != "Hello there, friend! 👋"
        assert (used < full) == stopped  # the generation ended at the stop
        assert len(engine.aborted) - num_aborted == stopped  # there, in the engine too
    assert engine.params[-1].stop_token_ids  # Harmony's own stop tokens still apply


def test_an_error_message_quotes_the_chat_field(served) -> None:
    url, _, _ = served
    content = '{"model": "demo", "messages": [{"role": "user", "content": "\\ud800"}]}'
    response = httpx.post(f"{url}/v1/chat/completions", content=content,
                          headers={"content-type": "application/json"})  # fmt: skip
    error = _error(response)
    assert error["param"] == "messages[0].content" and "'messages[0].content'" in error["message"]


def test_an_unknown_model_is_a_404_and_a_failed_generation_a_500(served) -> None:
    url, _, engine = served
    body = {"model": "gpt-4o", "messages": HI}
    assert _error(httpx.post(f"{url}/v1/chat/completions", json=body), 404)["param"] == "model"
    engine.queue([*harmony_tokens("<|channel|>analysis<|message|>Hm"), RuntimeError("GPU gone")])
    error = _error(httpx.post(f"{url}/v1/chat/completions",
                              json={"model": "demo", "messages": HI}), 500)  # fmt: skip
    assert error["type"] == "server_error" and "GPU gone" in error["message"]
    engine.queue([*harmony_tokens("<|channel|>analysis<|message|>Hm"), RuntimeError("GPU gone")])
    body = {"model": "demo", "messages": HI, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert json.loads(lines[-2][6:])["error"]["code"] == "server_error"
    assert lines[-1] == "data: [DONE]"


def test_the_demo_model_through_the_sdk(demo_dir: Path) -> None:
    engine = CpuEngine(load_model(demo_dir), "demo")
    with running_server(create_app(engine, ResponseStore(":memory:"), ServerConfig())) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        completion = _valid(client.chat.completions.create(
            model="demo", messages=HI, max_completion_tokens=16, seed=7
        ))  # fmt: skip
        assert completion.choices[0].finish_reason in ("stop", "length")
        assert completion.usage.completion_tokens <= 16
        chunks = list(client.chat.completions.create(
            model="demo", messages=HI, max_completion_tokens=16, seed=7, stream=True
        ))  # fmt: skip
        for chunk in chunks:
            ChatCompletionChunk.model_validate(chunk.model_dump(mode="json"))
        assert chunks[-1].choices[0].finish_reason == completion.choices[0].finish_reason
        pair = _valid(client.chat.completions.create(
            model="demo", messages=HI, max_completion_tokens=8, seed=7, n=2
        ))  # fmt: skip
        assert [choice.index for choice in pair.choices] == [0, 1]
        assert pair.usage.completion_tokens <= 16
