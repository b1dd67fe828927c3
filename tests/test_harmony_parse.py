import random

import pytest

from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import (
    ContentDelta,
    MessageDone,
    MessageStarted,
    ParseEvent,
)
from gptoss_serve.harmony.parse import HarmonyStreamParser

JSON = "<|constrain|>json"


def _tokens(completion: str) -> list[int]:
    return adapter.encoding().encode(completion, allowed_special="all")


def _parse(token_ids: list[int]) -> tuple[list[ParseEvent], HarmonyStreamParser]:
    parser = HarmonyStreamParser()
    events = [event for token_id in token_ids for event in parser.feed(token_id)]
    return events + parser.finish(), parser


def _events(completion: str) -> list[ParseEvent]:
    events, parser = _parse(_tokens(completion))
    assert parser.framing_error is None
    return events


def _message(
    text: str, channel: str | None, recipient: str | None = None, content_type: str | None = None
) -> list[ParseEvent]:
    """The events of one well-formed message: one delta per token of plain ASCII text."""
    deltas = [ContentDelta(adapter.decode([t])) for t in adapter.encode(text)]
    return [
        MessageStarted(channel, recipient, content_type),
        *deltas,
        MessageDone(channel, recipient, content_type, text),
    ]


def test_reasoning_then_final() -> None:
    events = _events(
        "<|channel|>analysis<|message|>User greets. Reply.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>"
    )
    assert events == _message("User greets. Reply.", "analysis") + _message("Hello there!", "final")


def test_reasoning_preamble_and_function_call() -> None:
    events = _events(
        "<|channel|>analysis<|message|>Need weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Oslo"}<|call|>'
    )
    assert events == (
        _message("Need weather.", "analysis")
        + _message("Checking the forecast.", "commentary")
        + _message('{"city":"Oslo"}', "commentary", "functions.get_weather", JSON)
    )


@pytest.mark.parametrize(
    "header",
    [
        " to=functions.f<|channel|>commentary <|constrain|>json",  # role part, first message
        "<|channel|>commentary to=functions.f <|constrain|>json",  # after the channel
        "<|channel|>analysis<|message|>x<|end|>"
        "<|start|>assistant to=functions.f<|channel|>commentary <|constrain|>json",
        "<|channel|>analysis<|message|>x<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json",
    ],
)
def test_recipient_in_role_part_or_after_channel(header: str) -> None:
    events = _events(header + '<|message|>{"a": 1}<|call|>')
    call = _message('{"a": 1}', "commentary", "functions.f", JSON)
    reasoning = _message("x", "analysis") if "analysis" in header else []
    assert events == reasoning + call


def test_refusal_without_channel() -> None:
    assert _events("<|message|>I can't help with that.<|end|>") == _message(
        "I can't help with that.", None
    )


def test_empty_message_is_started_and_done() -> None:
    assert _events("<|channel|>final<|message|><|return|>") == [
        MessageStarted("final", None, None),
        MessageDone("final", None, None, ""),
    ]


def test_stray_tokens_after_a_complete_message_are_ignored() -> None:
    events = _events(
        "<|channel|>analysis<|message|>Think.<|end|>"
        "stray text<|message|><|end|>"
        "<|start|>assistant<|channel|>final<|message|>Answer.<|return|>"
    )
    assert events == _message("Think.", "analysis") + _message("Answer.", "final")


def test_cut_off_mid_content_is_closed_by_finish() -> None:
    parser = HarmonyStreamParser()
    events = [e for t in _tokens("<|channel|>final<|message|>Half an ans") for e in parser.feed(t)]
    assert events == _message("Half an ans", "final")[:-1]
    assert parser.finish() == [MessageDone("final", None, None, "Half an ans")]
    assert parser.finish() == []


def test_cut_off_in_header_gives_nothing() -> None:
    assert _events("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fi") == (
        _message("a", "analysis")
    )


def test_multibyte_utf8_split_across_tokens() -> None:
    text = "héllo 😀 你好🎉 Ünïcödé ✓"
    token_ids = _tokens(f"<|channel|>final<|message|>{text}<|return|>")
    events, _ = _parse(token_ids)
    deltas = [e.text for e in events if isinstance(e, ContentDelta)]
    # Some characters span tokens, so fewer deltas than content tokens, and none broken.
    assert len(deltas) < len(adapter.encode(text))
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert events[0] == MessageStarted("final", None, None)
    assert events[-1] == MessageDone("final", None, None, text)


def test_special_tokens_inside_content_are_text() -> None:
    # The library's choice: only <|end|>, <|return|> and <|call|> end content.
    events = _events("<|channel|>final<|message|>a<|start|>b<|channel|>c<|return|>")
    assert events[-1] == MessageDone("final", None, None, "a<|start|>b<|channel|>c")


def test_framing_error_in_header_resynchronises_at_start() -> None:
    events, parser = _parse(
        _tokens(
            "<|channel|>analysis<|message|>Think.<|end|>"
            "<|start|>bogus<|channel|>final<|message|>lost<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Answer.<|return|>"
        )
    )
    assert events == _message("Think.", "analysis") + _message("Answer.", "final")
    assert parser.framing_error is not None and "bogus" in parser.framing_error


def test_framing_error_in_first_header() -> None:
    events, parser = _parse(_tokens("<|channel|><|message|>x<|end|>"))
    assert events == [] and parser.framing_error is not None


def test_framing_error_mid_content_closes_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.0.8 never raises inside content; a future version might, so fake it.
    poison = adapter.encode("!")[0]

    class Raising(adapter.MessageTokenParser):
        def process(self, token_id: int) -> str | None:
            if token_id == poison:
                raise adapter.HarmonyFramingError("boom")
            return super().process(token_id)

    monkeypatch.setattr(adapter, "MessageTokenParser", Raising)
    events, parser = _parse(
        _tokens(
            "<|channel|>final<|message|>Hi! more<|return|>"
            "<|start|>assistant<|channel|>final<|message|>Again<|return|>"
        )
    )
    assert events == _message("Hi", "final") + _message("Again", "final")
    assert parser.framing_error == "boom"


def test_current_channel_follows_header_and_content() -> None:
    parser = HarmonyStreamParser()
    seen = []
    completion = (
        "<|channel|>analysis<|message|>a<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.f<|message|>{}<|call|>"
    )
    for token_id in _tokens(completion):
        parser.feed(token_id)
        seen.append((adapter.decode([token_id]), parser.current_channel))
    assert seen == [
        ("<|channel|>", None),
        ("analysis", "analysis"),
        ("<|message|>", "analysis"),
        ("a", "analysis"),
        ("<|end|>", None),
        ("<|start|>", None),
        ("assistant", None),
        ("<|channel|>", None),
        ("comment", None),
        ("ary", "commentary"),
        (" to", "commentary"),
        ("=", "commentary"),
        ("functions", "commentary"),
        (".f", "commentary"),
        ("<|message|>", "commentary"),
        ("{}", "commentary"),
        ("<|call|>", None),
    ]


@pytest.mark.parametrize("seed", range(5))
def test_random_tokens_never_raise(seed: int) -> None:
    rng = random.Random(seed)
    specials = _tokens("<|start|><|message|><|end|><|channel|><|return|><|call|>assistant")
    # Mostly uniform ids, with some framing tokens so that messages actually open and close.
    token_ids = [
        rng.choice(specials) if rng.random() < 0.2 else rng.randrange(201088) for _ in range(300)
    ]
    events, _ = _parse(token_ids)
    # Whatever the input, the events are well nested and Done carries the deltas' text.
    open_message, parts = None, []
    for event in events:
        if isinstance(event, MessageStarted):
            assert open_message is None
            open_message, parts = event, []
        elif isinstance(event, ContentDelta):
            assert open_message is not None
            parts.append(event.text)
        else:
            assert open_message is not None and event.text == "".join(parts)
            assert event.channel == open_message.channel
            open_message = None
    assert open_message is None


def test_uniform_random_tokens_never_raise() -> None:
    rng = random.Random(1234)
    _parse([rng.randrange(201088) for _ in range(300)])
