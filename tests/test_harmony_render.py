"""render_prompt: golden transcripts (decoded prompt text) plus the key facts asserted directly.

Regenerate the golden files after an intended change with ``UPDATE_GOLDEN=1 pytest ...``
and review the diff.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

import pytest

from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import (
    Compaction,
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    Item,
    Message,
    Reasoning,
    RenderRequest,
    ResponseFormat,
)
from gptoss_serve.harmony.render import COMPACTION_INTRO, compacted_away, render_prompt
from gptoss_serve.server.context_fit import token_bounds

GOLDEN = Path(__file__).resolve().parent / "golden"
TODAY = dt.date(2026, 1, 2)

WEATHER = FunctionTool(
    name="get_weather",
    description="Current weather at a place.",
    parameters={
        "type": "object",
        "properties": {
            "location": {
                "type": "object",
                "description": "Where to look.",
                "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                "required": ["city"],
            },
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["location"],
    },
)
SEARCH = FunctionTool(
    name="search_docs",
    description="Search the documentation.",
    parameters={
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "Words to look for."},
            "limit": {"type": "integer"},
        },
        "required": ["query"],
    },
)
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
ANSWER_JSON = (
    '{"type":"object","properties":{"answer":{"type":"string"},"confidence":{"type":"number"}},'
    '"required":["answer","confidence"],"additionalProperties":false}'
)


def _render(items: tuple[Item, ...], **options: Any) -> str:
    text = adapter.decode(render_prompt(RenderRequest(items=items, today=TODAY, **options)))
    assert text.endswith("<|start|>assistant")
    return text


def _assert_golden(name: str, text: str) -> None:
    # Stored with one trailing newline so editors and end-of-file fixers leave it alone.
    path = GOLDEN / f"harmony_render_{name}.txt"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        path.write_bytes((text + "\n").encode())
    assert path.read_bytes().decode() == text + "\n"


def _developer_message(text: str) -> str:
    start = text.index("<|start|>developer<|message|>")
    return text[start : text.index("<|end|>", start) + len("<|end|>")]


def _weather_turn(city: str) -> tuple[Item, ...]:
    """A user question answered by a tool call and its output (the answer not yet given)."""
    return (
        Message("user", f"Weather in {city}?"),
        Reasoning(f"Need the weather tool for {city}."),
        FunctionCall("call_1", "get_weather", f'{{"location":{{"city":"{city}"}}}}'),
        FunctionCallOutput("call_1", "get_weather", '{"temperature":3}'),
    )


def test_plain_user_message() -> None:
    text = _render((Message("user", "What is 2+2?"),))
    _assert_golden("plain", text)
    assert text.startswith(
        "<|start|>system<|message|>" + adapter.MODEL_IDENTITY + "\n"
        f"Knowledge cutoff: {adapter.KNOWLEDGE_CUTOFF}\nCurrent date: 2026-01-02\n\n"
        "Reasoning: medium\n\n"
    )
    assert "<|start|>developer" not in text
    assert text.endswith("<|end|><|start|>user<|message|>What is 2+2?<|end|><|start|>assistant")


def test_instructions_and_function_tools() -> None:
    text = _render(
        (Message("user", "Weather in Oslo?"),),
        instructions="Be terse.",
        tools=(WEATHER, SEARCH),
        reasoning_effort="high",
    )
    _assert_golden("tools", text)
    developer = _developer_message(text)
    assert developer.startswith("<|start|>developer<|message|># Instructions\n\nBe terse.\n\n")
    assert "## functions\n\nnamespace functions {\n\n// Current weather at a place.\n" in developer
    assert "type get_weather = (_: {" in developer and "type search_docs = (_: {" in developer
    assert 'unit?: "celsius" | "fahrenheit",' in developer  # enum, optional
    # Nested object, required: `location:` without `?` (the library's layout of a described
    # nested object is odd, repeating its comment; the golden file records it exactly).
    assert "\nlocation: " in developer and "\n    country?: string," in developer
    assert "query: string," in developer and "limit?: number," in developer
    assert "Reasoning: high" in text


def test_json_schema_response_format() -> None:
    answer = ResponseFormat("answer", ANSWER_SCHEMA, description="A short answer.", strict=True)
    text = _render((Message("user", "2+2?"),), instructions="Be terse.", response_format=answer)
    _assert_golden("response_format", text)
    expected = f"# Response Formats\n\n## answer\n\n// A short answer.\n{ANSWER_JSON}<|end|>"
    assert _developer_message(text) == (
        "<|start|>developer<|message|># Instructions\n\nBe terse.\n\n" + expected
    )


def test_response_format_alone_and_after_tools() -> None:
    answer = ResponseFormat("answer", ANSWER_SCHEMA)
    alone = _render((Message("user", "2+2?"),), response_format=answer)
    section = f"# Response Formats\n\n## answer\n\n{ANSWER_JSON}<|end|>"  # no // line
    assert _developer_message(alone) == "<|start|>developer<|message|>" + section
    with_tools = _render((Message("user", "2+2?"),), tools=(WEATHER,), response_format=answer)
    assert _developer_message(with_tools).endswith("} // namespace functions\n\n" + section)


def test_response_format_ignores_end_text_in_instructions() -> None:
    # Text that spells a special token is plain text: the section goes before the real <|end|>.
    answer = ResponseFormat("answer", ANSWER_SCHEMA)
    token_ids = render_prompt(
        RenderRequest(
            items=(Message("user", "hi"),),
            instructions="a<|end|>b",
            response_format=answer,
            today=TODAY,
        )
    )
    text = adapter.decode(token_ids)
    section = f"# Response Formats\n\n## answer\n\n{ANSWER_JSON}<|end|>"
    assert "<|start|>developer<|message|># Instructions\n\na<|end|>b\n\n" + section in text
    assert token_ids.count(adapter.special_token_id("<|end|>")) == 3  # system, developer, user


def test_tool_call_round_trip() -> None:
    text = _render(_weather_turn("Oslo"), tools=(WEATHER,))
    _assert_golden("tool_call", text)
    assert text.endswith(
        "<|start|>user<|message|>Weather in Oslo?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather tool for Oslo.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"location":{"city":"Oslo"}}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary"
        '<|message|>{"temperature":3}<|end|><|start|>assistant'
    )


def test_chain_of_thought_dropped_before_last_final() -> None:
    items = (
        Message("user", "Hi."),
        Reasoning("First thoughts."),
        Message("assistant", "Hello!", channel="final"),
        Message("user", "How are you?"),
        Reasoning("Second thoughts."),
        Message("assistant", "Fine."),  # no channel: a final answer too
        *_weather_turn("Oslo"),
    )
    text = _render(items, tools=(WEATHER,))
    _assert_golden("cot_drop", text)
    assert "First thoughts." not in text and "Second thoughts." not in text
    assert "<|channel|>analysis<|message|>Need the weather tool for Oslo.<|end|>" in text
    assert "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>" in text
    assert "<|start|>assistant<|channel|>final<|message|>Fine.<|end|>" in text


def test_preamble_is_not_a_final_answer() -> None:
    items = (
        Message("user", "Hi."),
        Reasoning("Kept thoughts."),
        Message("assistant", "Let me check.", channel="commentary"),
        Message("user", "Go on."),
    )
    text = _render(items, tools=(WEATHER,))
    assert "<|channel|>analysis<|message|>Kept thoughts.<|end|>" in text
    assert "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>" in text


def test_system_and_developer_messages_fold_into_instructions() -> None:
    items = (
        Message("system", "Answer in French."),
        Message("user", "Hi."),
        Message("developer", "Never use emoji."),
    )
    text = _render(items, instructions="Be terse.")
    _assert_golden("folded_instructions", text)
    assert _developer_message(text) == (
        "<|start|>developer<|message|># Instructions\n\n"
        "Be terse.\n\nAnswer in French.\n\nNever use emoji.<|end|>"
    )
    assert text.count("Answer in French.") == 1 and text.count("Never use emoji.") == 1
    assert text.endswith("<|start|>user<|message|>Hi.<|end|><|start|>assistant")
    # Without request.instructions a developer-role message alone still makes the message.
    alone = _render((Message("developer", "Never use emoji."), Message("user", "Hi.")))
    assert "<|start|>developer<|message|># Instructions\n\nNever use emoji.<|end|>" in alone


@pytest.mark.parametrize("has_tools", [False, True])
def test_commentary_channel_only_with_tools(has_tools: bool) -> None:
    tools = (WEATHER,) if has_tools else ()
    text = _render((Message("user", "Hi."),), tools=tools)
    if has_tools:
        assert "# Valid channels: analysis, commentary, final." in text
    else:
        assert "# Valid channels: analysis, final." in text
        assert "commentary" not in text


def test_bad_reasoning_effort() -> None:
    with pytest.raises(ValueError, match="reasoning_effort"):
        render_prompt(RenderRequest(items=(), reasoning_effort="extreme", today=TODAY))  # type: ignore[arg-type]


def test_a_compaction_stands_in_for_the_items_before_it_but_the_user_messages() -> None:
    call = FunctionCall("call_1", "get_weather", '{"location": "Oslo"}')
    before = [
        Message("user", "First."), Reasoning("Think."), call,
        FunctionCallOutput("call_1", "get_weather", "12 C"), Message("assistant", "12 C."),
        Compaction("Old summary."), Message("user", "Second."), Message("developer", "Be terse."),
    ]  # fmt: skip
    after = [Compaction("New summary."), Message("assistant", "Go on."), Message("user", "Third.")]
    items = (*before, *after)
    kept = [Message("user", "First."), Message("user", "Second."),
            Message("developer", "Be terse."), *after]  # fmt: skip
    assert compacted_away(items) == {1, 2, 3, 4, 5}
    assert compacted_away(before[:5]) == frozenset()  # no compaction: nothing out
    assert render_prompt(RenderRequest(items, today=TODAY)) == render_prompt(
        RenderRequest(tuple(kept), today=TODAY)
    )
    text = adapter.decode(render_prompt(RenderRequest(items, today=TODAY)))
    assert "Be terse." in text  # system/developer messages still fold into the instructions
    assert text.endswith(
        f"<|start|>user<|message|>{COMPACTION_INTRO}New summary.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Go on.<|end|>"
        "<|start|>user<|message|>Third.<|end|><|start|>assistant"
    )
    # What the render leaves out counts nothing towards the context.
    bounds = token_bounds(items, 131072)
    assert [bounds[index] for index in (1, 2, 3, 4, 5)] == [0] * 5 and bounds[0] > 0
