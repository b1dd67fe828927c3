"""A request's constraint as plain data -> the grammar of a whole Harmony assistant turn.

Pure functions, no grammar library: the text is llguidance's Lark-like syntax (special tokens
as ``<|end|>``, JSON Schemas inlined as ``%json {...}``, ``max_tokens`` on a terminal rule),
which ``adapter.py`` compiles. Generation starts right after the prompt's
``<|start|>assistant``, so the grammar spells each message from its header on:

    turn      := analysis[?] preamble? answer
    analysis  := <|channel|>analysis<|message|> TEXT(<= budget tokens) <|end|> <|start|>assistant
    preamble  := <|channel|>commentary<|message|> TEXT(<= preamble cap) <|end|> <|start|>assistant
    answer    := final | call
    final     := <|channel|>final<|message|> (TEXT | JSON(schema)) <|return|>
    call      := <|channel|>commentary to=RECIPIENT <|constrain|>json<|message|> JSON <|call|>

A call's recipient is ``functions.NAME`` for a top-level function and ``NAMESPACE.NAME`` for
a function of a ``namespace`` tool.

This is the form our renderer writes and openai-harmony parses (docs/constrained-decoding.md).
The analysis opens a plain turn (no JSON format, no forced call), as in gpt-oss's own turns,
and is optional otherwise (a model may answer at once); once its text reaches the budget
only ``<|end|>`` may follow, so the answer always begins. Texts cannot contain special tokens:
a grammar's regular expressions match bytes of ordinary tokens only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gptoss_serve.harmony.conversation import FUNCTIONS, recipient

# One-line JSON with at most one space after `,` and `:` (`{"a":1,"b":2}` as in Harmony's own
# examples, or `{"a": 1, "b": 2}`): a model cannot pad its answer with whitespace forever.
# The separators are regular expressions.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# A preamble ("Let me check.") is a sentence or two: at most this many tokens, and at most half
# the reasoning budget, so analysis and preamble together stay under 1.5 budgets.
PREAMBLE_MAX_TOKENS = 64
_FREE_TEXT = "/(?s:.*)/"


@dataclass(frozen=True)
class ToolConstraint:
    """A function a call may go to; ``parameters`` is the schema its arguments must match
    (None: any JSON object); ``namespace`` the Harmony namespace it is declared in."""

    name: str
    parameters: dict[str, Any] | None = None
    namespace: str = FUNCTIONS

    @property
    def recipient(self) -> str:
        return recipient(self.namespace, self.name)


@dataclass(frozen=True)
class ConstraintSpec:
    """What one response may contain.

    ``tools``: the functions a call may go to (empty: no call). ``require_call``: the answer
    must be a call (no final message). ``response_schema``: the final message's content must
    be JSON matching it (None: free text). ``reasoning_budget``: at most this many tokens of
    analysis text; 0 allows no analysis message at all. ``require_reasoning``: with a budget,
    the turn opens with its analysis message (as gpt-oss's own turns do); else the analysis is
    optional, so an answer written first is still held to the format. A preamble (a commentary
    message before a call) may take ``preamble_budget`` tokens.
    """

    tools: tuple[ToolConstraint, ...] = ()
    require_call: bool = False
    response_schema: dict[str, Any] | None = None
    reasoning_budget: int = 1024
    require_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.require_call and not self.tools:
            raise ValueError("require_call needs at least one tool")
        if self.reasoning_budget < 0:
            raise ValueError(f"reasoning_budget must be >= 0, got {self.reasoning_budget}")

    @property
    def preamble_budget(self) -> int:
        """Most tokens of preamble text; 0 when there is nothing to call (no preamble)."""
        return min(PREAMBLE_MAX_TOKENS, self.reasoning_budget // 2) if self.tools else 0


def json_grammar(schema: dict[str, Any]) -> str:
    """``%json {...}``: the schema with our formatting options (replacing any of the
    client's own ``x-guidance``, which could switch off checks)."""
    options = {**{k: v for k, v in schema.items() if k != "x-guidance"}, "x-guidance": JSON_OPTIONS}
    return "%json " + json.dumps(options, separators=(",", ":"), sort_keys=False)


def schema_grammar(schema: dict[str, Any]) -> str:
    """A grammar of one JSON value alone: to check a schema before any generation."""
    return f"%llguidance {{}}\nstart: {json_grammar(schema)}\n"


def build_grammar(spec: ConstraintSpec) -> str:
    """The grammar of one assistant turn under ``spec``."""
    budget = spec.reasoning_budget
    has_reasoning = budget > 0
    has_preamble = spec.preamble_budget > 0
    turn = " ".join(
        part
        for part, present in (
            ("analysis" if spec.require_reasoning else "analysis?", has_reasoning),
            ("preamble?", has_preamble),
            ("answer", True),
        )
        if present
    )
    answers = ([] if spec.require_call else ["final"]) + (["call"] if spec.tools else [])
    lines = ["%llguidance {}", f"start: {turn}", f"answer: {' | '.join(answers)}"]
    next_header = '<|end|> <|start|> "assistant"'
    if has_reasoning:
        lines += [
            f'analysis: <|channel|> "analysis" <|message|> analysis_text {next_header}',
            f"analysis_text[max_tokens={budget}]: {_FREE_TEXT}",
        ]
    if has_preamble:
        lines += [
            f'preamble: <|channel|> "commentary" <|message|> preamble_text {next_header}',
            f"preamble_text[max_tokens={spec.preamble_budget}]: {_FREE_TEXT}",
        ]
    if not spec.require_call:
        body = _FREE_TEXT if spec.response_schema is None else json_grammar(spec.response_schema)
        lines += ['final: <|channel|> "final" <|message|> final_body <|return|>',
                  f"final_body: {body}"]  # fmt: skip
    if spec.tools:
        lines += _call_rules(spec.tools)
    return "\n".join(lines) + "\n"


def _call_rules(tools: tuple[ToolConstraint, ...]) -> list[str]:
    calls = " | ".join(f"call_{index}" for index in range(len(tools)))
    lines = [f'call: <|channel|> "commentary to=" ({calls})']
    for index, tool in enumerate(tools):
        # Tool and namespace names are [a-zA-Z0-9_-]+ (the protocol checks it): safe in a
        # string literal.
        lines += [
            f'call_{index}: "{tool.recipient} " <|constrain|> "json" <|message|> args_{index} '
            "<|call|>",
            f"args_{index}: {json_grammar(tool.parameters or ANY_OBJECT)}",
        ]
    return lines
