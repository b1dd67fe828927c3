"""render_prompt composes kept renders (its header, each history message): the tokens must be
exactly those of openai-harmony rendering the whole conversation in one call, for any
conversation, and a second prompt with the same header and history renders only what is new."""

from __future__ import annotations

import datetime as dt
import random

import pytest

from gptoss_serve.harmony import adapter, render
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
    ToolNamespace,
)
from gptoss_serve.harmony.token_lru import TokenLru

# Texts that could confuse a composition: special tokens spelled out, emoji, CJK, empty ones.
PIECES = ["hello", " world", "é", "🙂", "<|end|>", "\n", "  ", '{"a":1}', "functions.x", "to=",
          "<|start|>", "日本", "", "a" * 50, "<|call|>", "assistant"]  # fmt: skip


def whole_render(request: RenderRequest) -> list[int]:
    """The prompt as one call of the library renders it (the reference; render_prompt before
    it kept any render)."""
    instructions = render._instructions(request)
    has_developer = (
        instructions is not None or bool(request.tools) or request.response_format is not None
    )
    channels = ("analysis", "commentary", "final") if request.tools else ("analysis", "final")
    token_ids = adapter.render_completion_prompt(
        [render._message_spec(item) for item in render._visible_items(request.items)],
        reasoning_effort=request.reasoning_effort,
        today=request.today,
        channels=channels,
        has_developer=has_developer,
        instructions=instructions or None,
        tools=[
            adapter.ToolSpec(t.name, t.description, t.parameters, t.namespace)
            for t in request.tools
        ],
        namespace_descriptions={n.name: n.description for n in request.namespaces},
    )
    if request.response_format is not None:
        token_ids = render._insert_response_format(token_ids, request.response_format)
    return token_ids


def random_request(rng: random.Random, day: int) -> RenderRequest:
    def text() -> str:
        return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))

    items: list[Item] = []
    for _ in range(rng.randint(1, 10)):
        namespace = rng.choice(["functions", "ns", "multi_agent_v1"])
        kind = rng.randrange(6)
        if kind == 0:
            role = rng.choice(["user", "assistant", "system", "developer"])
            items.append(Message(role, text(), rng.choice([None, "final", "commentary"])))
        elif kind == 1:
            items.append(Reasoning(text()))
        elif kind == 2:
            items.append(FunctionCall("c", rng.choice(["f", "g_1"]), text(), namespace))
        elif kind == 3:
            items.append(FunctionCallOutput("c", "f", text(), namespace))
        elif kind == 4:
            items.append(Compaction(text()))  # what it stands in for leaves the prompt
        else:
            items.append(Message("user", text()))
    tools = tuple(
        FunctionTool(f"f{i}", text() or None, {"type": "object", "properties": {
            "x": {"type": rng.choice(["string", "integer"]), "description": text()}}},
            namespace=rng.choice(["functions", "ns"]))
        for i in range(rng.randint(0, 3))
    )  # fmt: skip
    namespaces = (ToolNamespace("ns", text() or None),) if tools else ()
    fmt = ResponseFormat("fmt", {"type": "object"}, text() or None) if rng.random() < 0.3 else None
    return RenderRequest(
        items=tuple(items), instructions=text() or None, tools=tools, namespaces=namespaces,
        reasoning_effort=rng.choice(["low", "medium", "high"]), response_format=fmt,
        today=dt.date(2026, 1, 1 + day % 28),
    )  # fmt: skip


def test_a_composed_prompt_is_the_whole_render_token_for_token() -> None:
    rng = random.Random(11)
    requests = [random_request(rng, day) for day in range(200)]
    for request in [*requests, *requests]:  # the second pass from kept renders
        assert render.render_prompt(request) == whole_render(request)


def test_empty_system_messages_still_make_a_developer_message() -> None:
    request = RenderRequest(items=(Message("system", ""), Message("user", "Hi")),
                            today=dt.date(2026, 11, 30))  # fmt: skip
    prompt = adapter.decode(render.render_prompt(request))
    assert "<|start|>developer<|message|><|end|>" in prompt
    assert render.render_prompt(request) == whole_render(request)


def test_a_next_turn_renders_only_what_is_new(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render, "HEADERS", TokenLru(1 << 20))
    monkeypatch.setattr(render, "ITEMS", TokenLru(1 << 22))
    rendered: list[str] = []
    original = adapter.render_message

    def counting(spec: adapter.MessageSpec) -> list[int]:
        rendered.append(spec.text)
        return original(spec)

    monkeypatch.setattr(adapter, "render_message", counting)
    tools = (FunctionTool("lookup", "Look a word up.", {"type": "object"}, namespace="ns"),)
    first = RenderRequest(
        items=(Message("user", "Find it."), Reasoning("Call lookup."),
               FunctionCall("c1", "lookup", '{"w":"a"}', "ns")),
        instructions="You are an agent. " * 200, tools=tools,
        namespaces=(ToolNamespace("ns", "Words."),), today=dt.date(2026, 11, 30),
    )  # fmt: skip
    assert render.render_prompt(first) == whole_render(first)
    assert len(rendered) == 3 and len(render.HEADERS) == 1
    second = RenderRequest(**{**first.__dict__, "items": (
        *first.items, FunctionCallOutput("c1", "lookup", "alpha", "ns"))})  # fmt: skip
    assert render.render_prompt(second) == whole_render(second)
    assert rendered[3:] == ["alpha"] and len(render.HEADERS) == 1  # only the new item
    # Another day is another header; the same items come from the kept renders.
    later = RenderRequest(**{**second.__dict__, "today": dt.date(2026, 12, 1)})
    assert render.render_prompt(later) == whole_render(later)
    assert len(rendered) == 4 and len(render.HEADERS) == 2


def test_the_kept_renders_stay_within_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render, "ITEMS", TokenLru(64))
    items = tuple(Message("user", f"message {i} " * 5) for i in range(40))
    request = RenderRequest(items=items, today=dt.date(2026, 11, 30))
    assert render.render_prompt(request) == whole_render(request)
    assert 0 < render.ITEMS.num_tokens <= 64
    huge = RenderRequest(items=(Message("user", "word " * 500),), today=dt.date(2026, 11, 30))
    assert render.render_prompt(huge) == whole_render(huge)  # longer than the bound: not kept
    assert render.ITEMS.num_tokens <= 64
