"""GeneratedMessages: what the model generated for a message goes back into the prompts that
render the same message, and nothing else in a prompt changes."""

from __future__ import annotations

import datetime as dt

import pytest

from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import (
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    Item,
    Message,
    Reasoning,
    RenderRequest,
)
from gptoss_serve.harmony.render import render_item, render_prompt
from gptoss_serve.harmony.replay import GeneratedMessages

TOOLS = (FunctionTool("get_weather", "Current weather.", {"type": "object"}),)
CALL = FunctionCall("call_1", "get_weather", '{"city": "Oslo"}')
THINK = Reasoning("Need weather.")


def tokens(text: str) -> list[int]:
    return adapter.encoding().encode(text, allowed_special="all")


def prompt(*items: Item) -> list[int]:
    render = RenderRequest(items=items, tools=TOOLS, today=dt.date(2026, 1, 2))
    return render_prompt(render)


# The call as the model writes it (and the constrained grammar forces): the recipient after
# the channel, where openai-harmony renders it in the role.
GENERATED_CALL = tokens(
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
    '<|message|>{"city": "Oslo"}<|call|>'
)  # fmt: skip


def test_render_item_is_the_items_own_run_of_the_prompt() -> None:
    items = (
        Message("user", "Weather in Oslo?"), THINK, Message("assistant", "Let me check.",
        "commentary"), CALL, FunctionCallOutput("call_1", "get_weather", "sunny"),
    )  # fmt: skip
    whole = prompt(*items)
    runs = [render_item(item) for item in items]
    joined = [token for run in runs for token in run]
    start = len(whole) - len(joined) - len(tokens("<|start|>assistant"))
    assert whole[start : start + len(joined)] == joined


def test_a_call_replays_as_generated_and_the_rest_as_rendered() -> None:
    messages = GeneratedMessages(1 << 10)
    assert messages.remember(render_item(CALL), GENERATED_CALL)
    output = FunctionCallOutput("call_1", "get_weather", "sunny")
    rendered = prompt(Message("user", "Weather?"), THINK, CALL, output)
    replayed = messages.replay(rendered)
    call = render_item(CALL)
    at = next(i for i in range(len(rendered)) if rendered[i : i + len(call)] == call)
    assert replayed[:at] == rendered[:at]
    assert replayed[at : at + len(GENERATED_CALL)] == GENERATED_CALL
    assert replayed[at + len(GENERATED_CALL) :] == rendered[at + len(call) :]
    assert messages.num_messages == 1 and messages.num_tokens == len(GENERATED_CALL)


def test_a_first_message_gets_the_role_and_an_answer_the_rendered_terminator() -> None:
    """A response's first message follows the prompt's <|start|>assistant; an answer the model
    ended with <|return|> ends with <|end|> in a history, as rendered."""
    messages = GeneratedMessages(1 << 10)
    answer = Message("assistant", "Hello there", "final")
    # "Hel" + "lo" + " there": not the canonical tokens of the text
    generated = [
        *tokens("<|channel|>final<|message|>Hel"), *tokens("lo"), *tokens(" there<|return|>")
    ]  # fmt: skip
    assert messages.remember(render_item(answer), generated)
    replayed = messages.replay(prompt(Message("user", "Hi"), answer, Message("user", "Again")))
    expected = tokens("<|start|>assistant") + generated[:-1] + tokens("<|end|>")
    assert adapter.decode(expected) == adapter.decode(render_item(answer))
    assert any(replayed[i : i + len(expected)] == expected for i in range(len(replayed)))


def test_what_renders_the_same_or_is_not_a_whole_message_is_not_kept() -> None:
    messages = GeneratedMessages(1 << 10)
    rendered = render_item(THINK)
    assert not messages.remember(rendered, rendered)  # nothing to replay
    assert not messages.remember(rendered, tokens("<|channel|>analysis<|message|>Need"))  # cut
    inner = tokens("<|start|>assistant<|channel|>analysis<|message|>a<|start|>assistant b<|end|>")
    assert not messages.remember(rendered, inner)
    assert not messages.remember(render_item(Message("user", "Hi")), GENERATED_CALL)
    assert messages.num_messages == 0
    plain = prompt(Message("user", "Hi"), THINK, CALL)
    assert messages.replay(plain) is plain


def test_a_message_the_client_changed_renders_as_sent() -> None:
    messages = GeneratedMessages(1 << 10)
    messages.remember(render_item(CALL), GENERATED_CALL)
    changed = FunctionCall("call_1", "get_weather", '{"city": "Bergen"}')
    rendered = prompt(Message("user", "Weather?"), changed)
    assert messages.replay(rendered) == rendered


def test_the_least_recently_replayed_go_first_past_the_bound() -> None:
    calls = [FunctionCall(f"c{i}", "get_weather", f'{{"city": "{i}"}}') for i in range(3)]
    generated = [
        tokens('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
               f'{{"city": "{i}"}}<|call|>')
        for i in range(3)
    ]  # fmt: skip
    size = len(generated[0]) + len(tokens("<|start|>assistant"))
    messages = GeneratedMessages(2 * size)
    messages.remember(render_item(calls[0]), generated[0])
    messages.remember(render_item(calls[1]), generated[1])
    first = prompt(Message("user", "Hi"), calls[0])
    assert messages.replay(first) != first  # c0 used: c1 is now the oldest
    messages.remember(render_item(calls[2]), generated[2])
    assert messages.num_messages == 2 and messages.num_tokens == 2 * size
    assert messages.replay(first) != first
    second = prompt(Message("user", "Hi"), calls[1])
    assert messages.replay(second) == second


def test_off_keeps_nothing() -> None:
    messages = GeneratedMessages(0)
    assert not messages.remember(render_item(CALL), GENERATED_CALL)
    with pytest.raises(ValueError, match="max_tokens"):
        GeneratedMessages(-1)
