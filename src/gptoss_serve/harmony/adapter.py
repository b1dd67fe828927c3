"""The one module that imports ``openai_harmony`` (pinned in pyproject.toml).

The o200k_harmony encoding needs its vocabulary file; offline machines point
``TIKTOKEN_ENCODINGS_BASE`` at a folder holding ``o200k_base.tiktoken`` (the library reads
that variable itself; with internet access it downloads the file on first use).
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import openai_harmony as oh

from gptoss_serve.harmony.conversation import FUNCTIONS as FUNCTIONS_NAMESPACE

logger = logging.getLogger(__name__)

REASONING_EFFORTS = ("low", "medium", "high")
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
# The longest ordinary token of o200k, in bytes (a test checks it against ``vocabulary()``): a
# text of n bytes is at least n / 128 tokens.
MAX_TOKEN_BYTES = 128


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


# o200k's pre-tokenizer split (tiktoken's ``o200k_base`` pat_str); a grammar library needs it to
# tokenize forced text the way the model's tokenizer does.
O200K_SPLIT_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)  # fmt: skip


@dataclass(frozen=True)
class Vocabulary:
    """The whole o200k_harmony vocabulary as plain data (what a grammar library is built from).

    ``ordinary`` maps each ordinary token's bytes to its id; ``special`` maps each special
    token's text (``<|end|>``, ``<|reserved_200013|>`` ...) to its id; ids run 0..size-1.
    """

    ordinary: dict[bytes, int]
    special: dict[str, int]
    size: int
    split_pattern: str = O200K_SPLIT_PATTERN


@functools.cache
def vocabulary() -> Vocabulary:
    """Every token's bytes, read once from the loaded encoding (about a second)."""
    enc = encoding()
    special = {text: enc.encode(text, allowed_special="all")[0] for text in enc.special_tokens_set}
    special_ids = frozenset(special.values())
    size = max(special_ids) + 1  # the special tokens close the o200k_harmony id range
    ordinary = {
        _raw_bytes(token_id): token_id for token_id in range(size) if token_id not in special_ids
    }
    return Vocabulary(ordinary, special, size)


@functools.cache
def message_end_token_ids() -> frozenset[int]:
    """The tokens that close a message: ``<|end|>``, ``<|return|>`` and ``<|call|>``."""
    return frozenset(special_token_id(text) for text in ("<|end|>", "<|return|>", "<|call|>"))


def assistant_stop_token_ids() -> tuple[int, ...]:
    """Stop sampling at ``<|return|>`` or ``<|call|>`` only (never ``<|end|>``)."""
    return tuple(encoding().stop_tokens_for_assistant_actions())


# -- token-level parsing primitives (used by parse.py, which holds the policy) ----------------


@functools.lru_cache(maxsize=1 << 16)
def token_bytes(token_id: int) -> bytes:
    """One token's bytes (a special token's: its text); a part of a UTF-8 sequence as it is."""
    return _raw_bytes(token_id)


def _raw_bytes(token_id: int) -> bytes:
    # The library's public decode is lossy (text); its inner object gives the raw bytes.
    return bytes(encoding()._inner.decode_bytes([token_id]))


def is_special_token(token_id: int) -> bool:
    return encoding().is_special_token(token_id)


class MessageTokenParser:
    """``StreamableParser`` with its errors as HarmonyFramingError, and nothing more.

    ``after_start`` means the prompt already ended with ``<|start|>assistant``, so the header
    begins without a role; otherwise the parser waits for ``<|start|>``. Reading the
    library's ``state`` costs a JSON dump of the whole message, so callers track the phase
    from the special tokens themselves.
    """

    def __init__(self, *, after_start: bool) -> None:
        role = oh.Role.ASSISTANT if after_start else None
        self._parser = oh.StreamableParser(encoding(), role=role)

    def process(self, token_id: int) -> str | None:
        """Feed one token; return the UTF-8-safe content text it completed, if any."""
        try:
            self._parser.process(token_id)
        except oh.HarmonyError as error:
            raise HarmonyFramingError(str(error)) from error
        return self._parser.last_content_delta

    @property
    def channel(self) -> str | None:
        return self._parser.current_channel

    @property
    def recipient(self) -> str | None:
        return self._parser.current_recipient

    @property
    def content_type(self) -> str | None:
        return self._parser.current_content_type


# -- rendering a whole conversation (used by render.py) ---------------------------------------


@dataclass(frozen=True)
class ToolSpec:
    """A function tool, in plain data: of the ``functions`` namespace unless ``namespace``
    names another."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema of the arguments object
    namespace: str = FUNCTIONS_NAMESPACE


@dataclass(frozen=True)
class MessageSpec:
    """One history message in plain data. ``role`` is user, assistant or tool; a tool
    message's ``author_name`` is e.g. ``functions.get_weather``."""

    role: str
    text: str
    author_name: str | None = None
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None


@functools.cache
def special_token_id(text: str) -> int:
    """The id of one special token such as ``<|end|>`` (cached: each response's stream parser
    asks for six, and an encode is ~0.25 ms)."""
    ids = encoding().encode(text, allowed_special="all")
    if len(ids) != 1 or not encoding().is_special_token(ids[0]):
        raise ValueError(f"{text!r} is not a special token")
    return ids[0]


def render_completion_prompt(
    messages: Sequence[MessageSpec],
    *,
    reasoning_effort: str,
    today: dt.date,
    channels: Sequence[str],
    has_developer: bool = False,
    instructions: str | None = None,
    tools: Sequence[ToolSpec] = (),
    namespace_descriptions: Mapping[str, str | None] | None = None,
) -> list[int]:
    """System (+ developer) + history, ending with ``<|start|>assistant``. The developer
    message declares ``tools`` by namespace: ``functions`` first, then the others in the order
    their first tool comes, each with its entry of ``namespace_descriptions`` above it.

    The library's automatic analysis drop is off: the caller applies its own rule.
    """
    system = _system_message(reasoning_effort, today, channels)
    developer = (
        [_developer_message(instructions, tools, namespace_descriptions or {})]
        if has_developer
        else []
    )
    history = [_history_message(spec) for spec in messages]
    conversation = oh.Conversation.from_messages([system, *developer, *history])
    config = oh.RenderConversationConfig(auto_drop_analysis=False)
    return encoding().render_conversation_for_completion(conversation, oh.Role.ASSISTANT, config)


def render_message(spec: MessageSpec) -> list[int]:
    """One history message's tokens, exactly as ``render_completion_prompt`` renders it
    among the others (from its ``<|start|>`` to its ``<|end|>`` or ``<|call|>``)."""
    return encoding().render(_history_message(spec))


def _system_message(reasoning_effort: str, today: dt.date, channels: Sequence[str]) -> oh.Message:
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}")
    system = (
        oh.SystemContent.new()
        .with_model_identity(MODEL_IDENTITY)
        .with_knowledge_cutoff(KNOWLEDGE_CUTOFF)
        .with_conversation_start_date(today.isoformat())
        .with_reasoning_effort(oh.ReasoningEffort(reasoning_effort.capitalize()))
        .with_channel_config(oh.ChannelConfig.require_channels(list(channels)))
    )
    return oh.Message.from_role_and_content(oh.Role.SYSTEM, system)


def _developer_message(
    instructions: str | None, tools: Sequence[ToolSpec], namespaces: Mapping[str, str | None]
) -> oh.Message:
    developer = oh.DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions(instructions)
    by_namespace: dict[str, list[oh.ToolDescription]] = {FUNCTIONS_NAMESPACE: []}
    for tool in tools:
        # ToolDescription wants a str; an empty description renders no `//` line.
        description = oh.ToolDescription.new(tool.name, tool.description or "", tool.parameters)
        by_namespace.setdefault(tool.namespace, []).append(description)
    for name, descriptions in by_namespace.items():
        if descriptions:
            config = oh.ToolNamespaceConfig(
                name=name, description=namespaces.get(name), tools=descriptions
            )
            developer = developer.with_tools(config)
    return oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer)


def _history_message(spec: MessageSpec) -> oh.Message:
    role = oh.Role(spec.role)
    author = oh.Author.new(role, spec.author_name) if spec.author_name else oh.Author(role=role)
    message = oh.Message.from_author_and_content(author, spec.text)
    # The builders set fields in place; None means "absent" in the library too.
    message.channel = spec.channel
    message.recipient = spec.recipient
    message.content_type = spec.content_type
    return message
