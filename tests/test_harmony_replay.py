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
# The reasoning before it, in other tokens than its text's canonical encoding.
GENERATED_THINK = [*tokens("<|channel|>analysis<|message|>Need wea"), *tokens("ther.<|end|>")]
ASK = Message("user", "Weather in Oslo?")
OUTPUT = FunctionCallOutput("call_1", "get_weather", "sunny")


def respond(
    messages: GeneratedMessages, before: tuple[Item, ...], output: list[tuple[Item, list[int]]]
) -> tuple[list[int], list[int]]:
    """A response to the prompt of ``before`` that generated ``output`` (items and their
    tokens), kept: (its prompt, its generated tokens)."""
    prompt_ids = messages.replay(prompt(*before))
    generated, entries = [], []
    for item, item_tokens in output:
        entries.append((len(generated), len(generated) + len(item_tokens), render_item(item)))
        generated += item_tokens
    messages.remember(prompt_ids, generated, entries)
    return prompt_ids, generated


def test_render_item_is_the_items_own_run_of_the_prompt() -> None:
    items = (ASK, THINK, Message("assistant", "Let me check.", "commentary"), CALL, OUTPUT)
    whole = prompt(*items)
    joined = [token for item in items for token in render_item(item)]
    start = len(whole) - len(joined) - len(tokens("<|start|>assistant"))
    assert whole[start : start + len(joined)] == joined


def test_a_tool_loop_continues_what_was_generated_turn_after_turn() -> None:
    messages = GeneratedMessages(1 << 10)
    first, generated = respond(messages, (ASK,), [(THINK, GENERATED_THINK), (CALL, GENERATED_CALL)])
    assert messages.stats().num_messages == 2
    assert messages.stats().num_tokens == len(GENERATED_THINK) + 2 + len(GENERATED_CALL)
    loop = (ASK, THINK, CALL, OUTPUT)
    second = messages.replay(prompt(*loop))
    assert second[: len(first) + len(generated)] == first + generated
    assert second[len(first) + len(generated) :] == prompt(*loop)[-len(render_item(OUTPUT)) - 2 :]
    again = FunctionCall("call_2", "get_weather", '{"city": "Oslo"}')  # the same call, later
    _, more = respond(messages, loop, [(again, GENERATED_CALL[2:])])
    third = messages.replay(prompt(*loop, again, OUTPUT))
    assert third[: len(second) + len(more)] == second + more


def test_an_answer_comes_back_as_generated_with_the_history_terminator() -> None:
    """An answer the model ended with <|return|> ends with <|end|> in a history, as rendered;
    its text keeps the tokens the model spelled it in."""
    messages = GeneratedMessages(1 << 10)
    answer = Message("assistant", "Hello there", "final")
    generated = [
        *tokens("<|channel|>final<|message|>Hel"), *tokens("lo"), *tokens(" there<|return|>")
    ]  # fmt: skip
    first, _ = respond(messages, (Message("user", "Hi"),), [(answer, generated)])
    replayed = messages.replay(prompt(Message("user", "Hi"), answer, Message("user", "Again")))
    expected = tokens("<|start|>assistant") + generated[:-1] + tokens("<|end|>")
    assert adapter.decode(expected) == adapter.decode(render_item(answer))
    assert replayed[: len(first) - 2 + len(expected)] == first[:-2] + expected


def test_a_message_replays_only_after_what_preceded_it() -> None:
    """Two conversations make the same call in other tokens: each gets its own."""
    messages = GeneratedMessages(1 << 10)
    other = Message("user", "And in Oslo?")
    spelled = [*tokens('<|channel|>commentary to=functions.get_weather <|constrain|>json'
                       '<|message|>{"city": "Os'), *tokens('lo"}<|call|>')]  # fmt: skip
    respond(messages, (ASK,), [(CALL, GENERATED_CALL[2:])])
    respond(messages, (other,), [(CALL, spelled)])
    assert messages.stats().num_messages == 2
    for ask, generated in ((ASK, GENERATED_CALL[2:]), (other, spelled)):
        rendered = prompt(ask, CALL, OUTPUT)
        replayed = messages.replay(rendered)
        at = len(prompt(ask)) - 2
        assert replayed[at : at + 2 + len(generated)] == tokens("<|start|>assistant") + generated
    unknown = prompt(Message("user", "Bergen?"), CALL, OUTPUT)
    assert messages.replay(unknown) is unknown


def test_the_first_generation_of_a_message_stays_and_the_next_ones_follow_it() -> None:
    """Two responses to one prompt reason the same text in other tokens, then call with other
    arguments: the first spelling is what every prompt gets, the second response's call is
    kept after it (the prompt that sends that call back holds the first spelling)."""
    messages = GeneratedMessages(1 << 10)
    other_think = [*tokens("<|channel|>analysis<|message|>Ne"), *tokens("ed weather.<|end|>")]
    bergen = FunctionCall("call_2", "get_weather", '{"city": "Bergen"}')
    bergen_call = tokens('<|start|>assistant<|channel|>commentary to=functions.get_weather '
                         '<|constrain|>json<|message|>{"city": "Bergen"}<|call|>')  # fmt: skip
    first, _ = respond(messages, (ASK,), [(THINK, GENERATED_THINK), (CALL, GENERATED_CALL)])
    respond(messages, (ASK,), [(THINK, other_think), (bergen, bergen_call)])
    replayed = messages.replay(prompt(ASK, THINK, bergen, OUTPUT))
    expected = first + GENERATED_THINK + bergen_call
    assert replayed[: len(expected)] == expected


def test_what_renders_the_same_or_is_not_a_whole_message_is_not_kept() -> None:
    messages = GeneratedMessages(1 << 10)
    rendered = render_item(THINK)
    cut = tokens("<|channel|>analysis<|message|>Need")
    inner = tokens("<|channel|>analysis<|message|>a<|start|>assistant b<|end|>")
    for generated in (rendered[2:], cut, inner, []):
        respond(messages, (ASK,), [(THINK, generated)])
    respond(messages, (ASK,), [(Message("user", "Hi"), GENERATED_CALL[2:])])
    assert messages.stats().num_messages == 0
    plain = prompt(ASK, THINK, CALL)
    assert messages.replay(plain) is plain


def test_a_message_the_client_changed_and_those_after_it_render_as_sent() -> None:
    messages = GeneratedMessages(1 << 10)
    respond(messages, (ASK,), [(THINK, GENERATED_THINK), (CALL, GENERATED_CALL)])
    changed = Reasoning("Need the weather.")
    rendered = prompt(ASK, changed, CALL, OUTPUT)
    assert messages.replay(rendered) == rendered


def test_the_least_recently_replayed_go_first_past_the_bound() -> None:
    asks = [Message("user", f"Weather {i}?") for i in range(3)]
    size = len(GENERATED_CALL)
    messages = GeneratedMessages(2 * size)
    respond(messages, (asks[0],), [(CALL, GENERATED_CALL[2:])])
    respond(messages, (asks[1],), [(CALL, GENERATED_CALL[2:])])
    first = prompt(asks[0], CALL)
    assert messages.replay(first) != first  # 0 used: 1 is now the oldest
    respond(messages, (asks[2],), [(CALL, GENERATED_CALL[2:])])
    assert messages.stats().num_messages == 2 and messages.stats().num_tokens == 2 * size
    assert messages.replay(first) != first
    second = prompt(asks[1], CALL)
    assert messages.replay(second) == second


def test_off_keeps_nothing() -> None:
    messages = GeneratedMessages(0)
    respond(messages, (ASK,), [(CALL, GENERATED_CALL[2:])])
    assert messages.stats().num_messages == 0
    with pytest.raises(ValueError, match="max_tokens"):
        GeneratedMessages(-1)
