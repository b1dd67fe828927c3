"""The one module that imports ``openai_harmony`` (pinned in pyproject.toml).

The o200k_harmony encoding needs its vocabulary file; offline machines point
``TIKTOKEN_ENCODINGS_BASE`` at a folder holding ``o200k_base.tiktoken`` (the library reads
that variable itself; with internet access it downloads the file on first use).
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import openai_harmony as oh

logger = logging.getLogger(__name__)

REASONING_EFFORTS = ("low", "medium", "high")
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"


class HarmonyFramingError(ValueError):
    """The generated tokens do not follow the Harmony format."""


@functools.cache
def encoding() -> oh.HarmonyEncoding:
    """The o200k_harmony encoding (loaded once; raises if the vocabulary file is missing)."""
    return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


def encode(text: str) -> list[int]:
    """Plain text -> token ids (special-token text is encoded as ordinary text)."""
    return encoding().encode(text, disallowed_special=())


def decode(token_ids: Sequence[int]) -> str:
    return encoding().decode(list(token_ids))


def assistant_stop_token_ids() -> tuple[int, ...]:
    """Stop sampling at ``<|return|>`` or ``<|call|>`` only (never ``<|end|>``)."""
    return tuple(encoding().stop_tokens_for_assistant_actions())


def render_chat_prompt(
    user_text: str,
    *,
    reasoning_effort: str = "medium",
    instructions: str | None = None,
    today: dt.date | None = None,
) -> list[int]:
    """System (+ developer) + user messages, ending with ``<|start|>assistant``."""
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}")
    system = (
        oh.SystemContent.new()
        .with_model_identity(MODEL_IDENTITY)
        .with_knowledge_cutoff(KNOWLEDGE_CUTOFF)
        .with_conversation_start_date((today or dt.date.today()).isoformat())
        .with_reasoning_effort(oh.ReasoningEffort(reasoning_effort.capitalize()))
    )
    messages = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    if instructions:
        developer = oh.DeveloperContent.new().with_instructions(instructions)
        messages.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
    messages.append(oh.Message.from_role_and_content(oh.Role.USER, user_text))
    conversation = oh.Conversation.from_messages(messages)
    return encoding().render_conversation_for_completion(conversation, oh.Role.ASSISTANT)


@dataclass(frozen=True)
class ContentDelta:
    """New text of the message being generated, with its channel (analysis/commentary/final)."""

    channel: str | None
    recipient: str | None
    text: str


class AssistantParser:
    """Incremental parser of generated assistant tokens (wraps ``StreamableParser``)."""

    def __init__(self) -> None:
        self._parser = oh.StreamableParser(encoding(), role=oh.Role.ASSISTANT)

    def feed(self, token_id: int) -> ContentDelta | None:
        """Process one token; return the content it added, if any."""
        try:
            self._parser.process(token_id)
        except oh.HarmonyError as error:
            raise HarmonyFramingError(str(error)) from error
        delta = self._parser.last_content_delta
        if not delta:
            return None
        return ContentDelta(self._parser.current_channel, self._parser.current_recipient, delta)

    def finish(self) -> None:
        """Signal the end of generation (closes a message cut off mid-way)."""
        try:
            self._parser.process_eos()
        except oh.HarmonyError as error:
            raise HarmonyFramingError(str(error)) from error

    @property
    def num_messages(self) -> int:
        return len(self._parser.messages)
