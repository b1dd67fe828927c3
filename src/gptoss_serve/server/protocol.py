"""Request models of ``POST /v1/responses`` (pydantic), as the official API accepts them.

Validation failures become 400s whose ``param`` is the JSON path of the field (see
errors.py), so every model here is strict: unknown fields, unknown item/tool/part types and
out-of-range values are rejected, never silently ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gptoss_serve.bounded_cache import bounded_cache


class StrictModel(BaseModel):
    # strict: "10" is not an integer and "yes" is not a boolean (JSON types are exact).
    model_config = ConfigDict(extra="forbid", strict=True)


# -- content parts ----------------------------------------------------------------------------


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


# -- input items ------------------------------------------------------------------------------


class InputMessage(StrictModel):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content)


class CallerDirect(StrictModel):
    type: Literal["direct"]


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    # What the SDK's output objects carry back (`input += response.output`, dumped with their
    # nulls): a direct call, not async, the only kind this server makes; a `namespace` tool's
    # function names its namespace (null or "functions": a top-level function).
    caller: CallerDirect | None = None
    namespace: str | None = Field(default=None, min_length=1, max_length=64,
                                  pattern=r"^[a-zA-Z0-9_-]+$")  # fmt: skip
    # A bool that must be false (Literal[False] would take 0: 0 == False in Python).
    async_: bool | None = Field(default=None, alias="async")

    @field_validator("async_")
    @classmethod
    def _not_async(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("this server makes no async calls: it must be false")
        return value


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    caller: CallerDirect | None = None
    # The call's, found by call_id either way.
    name: str | None = None
    namespace: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(StrictModel):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or ())


class CompactionItem(StrictModel):
    """What ``/v1/responses/compact`` returns after the user messages: the summary of the
    conversation up to it (``encrypted_content``, server/reasoning_seal.py), sent back in
    place of the items it replaced."""

    type: Literal["compaction"]
    encrypted_content: str = Field(min_length=1)
    id: str | None = None
    created_by: str | None = None


class CompactionTrigger(StrictModel):
    """The last input item of a response that compacts its conversation first, whatever its
    size (server/compaction.py), then answers; no item of the conversation itself."""

    type: Literal["compaction_trigger"]
    id: str | None = None


class ItemReference(StrictModel):
    type: Literal["item_reference"]
    id: str = Field(min_length=1)


def _item_type(value: Any) -> str | None:
    # Messages may omit "type" (the SDK's EasyInputMessage); everything else names its type.
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[CompactionItem, Tag("compaction")]
    | Annotated[CompactionTrigger, Tag("compaction_trigger")]
    | Annotated[ItemReference, Tag("item_reference")],
    Discriminator(_item_type),
]


# -- tools, tool choice, text format ----------------------------------------------------------


def check_json_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A schema must be valid JSON Schema (its dialect's metaschema; 2020-12 where it names
    none), as the official API checks even where it does not enforce the schema."""
    if schema is None:
        return schema
    depth = _depth(schema, MAX_SCHEMA_DEPTH)
    if depth > MAX_SCHEMA_DEPTH:
        raise PydanticCustomError(
            "invalid_json_schema", "the schema nests more than {limit} levels of JSON",
            {"limit": MAX_SCHEMA_DEPTH},
        )  # fmt: skip
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        raise PydanticCustomError(
            "invalid_json_schema", "not valid JSON Schema at $.$schema: {dialect} is not a "
            "string", {"dialect": json.dumps(dialect)},
        )  # fmt: skip
    problem = _schema_problem(json.dumps(schema, sort_keys=True, separators=(",", ":")))
    if problem is not None:  # the code constraints.py gives schemas it cannot compile
        path, message = problem
        raise PydanticCustomError(
            "invalid_json_schema", "not valid JSON Schema at {path}: {problem}",
            {"path": path, "problem": message},
        )  # fmt: skip
    return schema


# The deepest nesting of objects and arrays a schema may have. The Harmony renderer refuses
# JSON past 128 levels (serde_json's recursion limit: a tool's parameters from ~118, in the
# conversation it renders) and jsonschema's metaschema check recurses past Python's stack from
# ~190; the real API's structured outputs allow 10 levels of nested objects (~20 of JSON).
MAX_SCHEMA_DEPTH = 64


def _depth(value: Any, limit: int) -> int:
    """Levels of JSON objects and arrays in ``value`` (a scalar: 0), counted up to limit + 1."""
    if limit < 0 or not isinstance(value, dict | list):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(child, limit - 1) for child in children), default=0)


# A larger schema is checked every time rather than kept: the cache holds at most 1024 x 64 KB.
_CACHED_SCHEMA_CHARS = 1 << 16


@bounded_cache(1024, _CACHED_SCHEMA_CHARS)
def _schema_problem(schema_json: str) -> tuple[str, str] | None:
    """(JSON path, message) of the first metaschema violation of a schema given as canonical
    JSON, or None. Cached: an agent sends the same tools with every request, and a check
    is ~2 ms (most of a plain request's preparation)."""
    schema = json.loads(schema_json)
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as error:
        return error.json_path, error.message
    return None


# The most functions a request declares (the real API's limit), namespaces' included.
MAX_TOOLS = 128


class FunctionSpec(StrictModel):
    """A function as both APIs describe it (Chat Completions nests it under ``function``)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _check_parameters = field_validator("parameters")(check_json_schema)


class FunctionToolParam(FunctionSpec):
    type: Literal["function"]


class NamespaceFunctionParam(FunctionSpec):
    """A function of a ``namespace`` tool (custom tools there are not served: a 400)."""

    type: Literal["function"]


class NamespaceToolParam(StrictModel):
    """Functions grouped under a name of their own (the SDK's NamespaceTool): the model calls
    them as ``{name}.{function}``, and a call's item carries ``namespace``. Harmony declares
    each namespace in the developer message, with its description above its functions."""

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str
    tools: list[NamespaceFunctionParam] = Field(min_length=1, max_length=MAX_TOOLS)


ToolParam = Annotated[FunctionToolParam | NamespaceToolParam, Field(discriminator="type")]


class ToolChoiceFunction(StrictModel):
    type: Literal["function"]
    name: str


class AllowedToolRef(StrictModel):
    type: Literal["function"]
    name: str


class ToolChoiceAllowed(StrictModel):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedToolRef] = Field(min_length=1)


ToolChoice = (
    Literal["none", "auto", "required"]
    | Annotated[ToolChoiceFunction | ToolChoiceAllowed, Field(discriminator="type")]
)


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    _check_schema = field_validator("schema_")(check_json_schema)


class TextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class TextConfig(StrictModel):
    format: Annotated[
        TextFormatText | TextFormatJsonSchema | TextFormatJsonObject, Field(discriminator="type")
    ] = Field(default_factory=lambda: TextFormatText(type="text"))
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(StrictModel):
    effort: Literal["low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    # The SDK's types still carry summary's deprecated name: taken, and echoed, the same way.
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


# -- the request ------------------------------------------------------------------------------


class StreamOptions(StrictModel):
    # Accepted and ignored: this server adds no `obfuscation` padding to its delta events (the
    # official API pads payload sizes against side channels on its network).
    include_obfuscation: bool | None = None


# The real API's floor on max_output_tokens (below it: integer_below_min_value).
MIN_OUTPUT_TOKENS = 16
# The largest reasoning_budget: the grammar's counters are unsigned 64-bit (2**64 failed to
# compile as a server error); no context comes near 2**31 tokens.
MAX_REASONING_BUDGET = (1 << 31) - 1


# Fields the SDK types as optional (`null` allowed) that have a default here: `null` is that
# default, as the official API takes it.
NULL_MEANS_DEFAULT = frozenset(
    {"background", "parallel_tool_calls", "reasoning", "store", "stream", "truncation"}
)
# The most output tokens a request may ask for: beyond it a count is no count (the context caps
# every response far below), and 2**70 echoed back broke 64-bit clients.
MAX_OUTPUT_TOKENS = (1 << 31) - 1


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    # The official limits: 16 pairs, keys up to 64 characters, values up to 512.
    if value is None:
        return value
    if len(value) > 16:
        raise ValueError("at most 16 key-value pairs")
    for key, item in value.items():
        if len(key) > 64:
            raise ValueError(f"key {key[:20]!r}... is longer than 64 characters")
        if len(item) > 512:
            raise ValueError(f"value of {key!r} is longer than 512 characters")
    return value


class ConversationRef(StrictModel):
    id: str = Field(min_length=1)


class ContextManagement(StrictModel):
    """Compaction inside a response: past ``compact_threshold`` tokens of prompt (None: 80% of
    the context window) the conversation is summarised first (server/compaction.py)."""

    type: Literal["compaction"]
    compact_threshold: int | None = Field(default=None, ge=1, le=MAX_OUTPUT_TOKENS)


class CreateResponseRequest(StrictModel):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    # The real API's limit (128 functions, counted across namespaces by responses.py);
    # llguidance's grammar of the tool names panics from 256.
    tools: list[ToolParam] = Field(default_factory=list, max_length=MAX_TOOLS)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: ReasoningConfig = Field(default_factory=ReasoningConfig)
    max_output_tokens: int | None = Field(default=None, ge=MIN_OUTPUT_TOKENS, le=MAX_OUTPUT_TOKENS)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    # A conversation (/v1/conversations): its items are the history, this response's input
    # and output items are added to it. Not with previous_response_id.
    conversation: Annotated[str, Field(min_length=1)] | ConversationRef | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    user: str | None = None
    # Accepted and echoed or ignored, as harmless hints: they change nothing on one server.
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    stream_options: StreamOptions | None = None
    # A client's own labels of the request (the Codex CLI sends its session and turn ids):
    # accepted and ignored, as the official API takes them; not echoed, nor limited as
    # `metadata` is.
    client_metadata: dict[str, str] | None = None
    # A limit on calls to built-in tools, and this server runs none: honoured as it is (echoed).
    max_tool_calls: int | None = Field(default=None, ge=0, le=MAX_OUTPUT_TOKENS)
    # Extension (not in the official API): most tokens of analysis text before the answer must
    # begin; 0 means no reasoning. Without it, the server's budget for the reasoning effort
    # (capped at half of the output tokens) applies. Send it with the SDK's `extra_body`.
    reasoning_budget: int | None = Field(default=None, ge=0, le=MAX_REASONING_BUDGET)
    context_management: list[ContextManagement] | None = Field(default=None, max_length=1)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in NULL_MEANS_DEFAULT):
            return {k: v for k, v in data.items() if v is not None or k not in NULL_MEANS_DEFAULT}
        return data

    _check_metadata = field_validator("metadata")(check_metadata)

    @property
    def conversation_id(self) -> str | None:
        """The conversation's id, from either form of ``conversation``."""
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation


class InputTokenCountRequest(StrictModel):
    """``POST /v1/responses/input_tokens``: the fields of a create request that make the prompt,
    each optional (``model``: the served one). ``personality`` is not served here (a 400
    naming it, as an unknown field)."""

    model: str | None = Field(default=None, min_length=1)
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    conversation: Annotated[str, Field(min_length=1)] | ConversationRef | None = None
    truncation: Literal["auto", "disabled"] | None = None

    def as_create_request(self, served_model: str) -> CreateResponseRequest:
        """The create request these fields make (defaults where they are null or not given).
        Built from the values validated here, not validated again: its types are the same."""
        fields = {name: getattr(self, name) for name in self.model_fields_set}
        fields = {name: value for name, value in fields.items() if value is not None}
        fields["model"] = self.model or served_model
        fields.setdefault("input", [])
        return CreateResponseRequest.model_construct(**fields)


class CompactImage(StrictModel):
    context_compression: Literal["enabled", "disabled"]


class CompactRequest(StrictModel):
    """``POST /v1/responses/compact``: the conversation to compact (``input``, after the
    ``previous_response_id`` chain's if given) and the instructions it runs under. The
    prompt-cache fields and ``service_tier`` are taken as hints and change nothing here."""

    model: str = Field(min_length=1)
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "fast", "flex", "priority"] | None = None
    image: CompactImage | None = None


# -- /v1/conversations ------------------------------------------------------------------------

# The official limit on the items one call adds (create, or add items).
MAX_ITEMS_PER_CALL = 20


class CreateConversationRequest(StrictModel):
    items: list[InputItem] | None = Field(default=None, max_length=MAX_ITEMS_PER_CALL)
    metadata: dict[str, str] | None = None

    _check_metadata = field_validator("metadata")(check_metadata)


class UpdateConversationRequest(StrictModel):
    metadata: dict[str, str] | None  # required; null clears it

    _check_metadata = field_validator("metadata")(check_metadata)


class AddConversationItemsRequest(StrictModel):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS_PER_CALL)
