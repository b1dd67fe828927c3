"""Request models of ``POST /v1/chat/completions``, and their translation into a Responses
request (the same checks, prompt and generation serve both APIs: chat_routes.py).

Strict as protocol.py's: unknown fields are a 400. Fields of the official API that change
nothing here are taken at their no-op values (penalties 0, an empty ``logit_bias``); any other
value of them, and features this server does not have (audio, images, ``store``d
completions), is a 400 naming the field rather than silently ignored. ``stop`` sequences and
``n`` choices are not Responses fields: chat_routes.py applies the first to the answer, and
runs the request n times (chat_choices.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from gptoss_serve.server.errors import bad_request
from gptoss_serve.server.protocol import (
    MAX_OUTPUT_TOKENS,
    MAX_TOOLS,
    FunctionSpec,
    StrictModel,
    check_json_schema,
    check_metadata,
)

MAX_CHOICES = 128  # the official API's bound on ``n``

# -- messages ---------------------------------------------------------------------------------


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class RefusalPart(StrictModel):
    type: Literal["refusal"]
    refusal: str


Text = str | list[TextPart]


def text_of(content: Text | list[TextPart | RefusalPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.refusal if isinstance(p, RefusalPart) else p.text for p in content)


class SystemMessage(StrictModel):
    role: Literal["system", "developer"]
    content: Text
    name: str | None = None


class UserMessage(StrictModel):
    role: Literal["user"]
    content: Text
    name: str | None = None


class ToolCallFunction(StrictModel):
    name: str = Field(min_length=1)
    arguments: str


class ToolCall(StrictModel):
    id: str = Field(min_length=1)
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(StrictModel):
    role: Literal["assistant"]
    content: Text | list[TextPart | RefusalPart] | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    name: str | None = None
    # The chain of thought of that turn, as this server (and vLLM) return it; sent back, it
    # stays in the prompt while a tool loop goes on (Harmony drops it after a final answer).
    reasoning_content: str | None = None
    reasoning: str | None = None
    # The rest of the SDK's ChatCompletionMessage, so that a returned message goes back as it
    # is (``messages.append(completion.choices[0].message)``): its url citations (this server
    # makes none) change nothing; audio and the legacy function_call only as null.
    annotations: list[dict[str, Any]] | None = None
    audio: None = None
    function_call: None = None


class ToolMessage(StrictModel):
    role: Literal["tool"]
    content: Text
    tool_call_id: str = Field(min_length=1)


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]

# -- tools and formats ------------------------------------------------------------------------


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(StrictModel):
    name: str


class ToolChoiceNamed(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(StrictModel):
    mode: Literal["auto", "required"]
    tools: list[ToolChoiceNamed] = Field(min_length=1)


class ToolChoiceAllowedTools(StrictModel):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ChatToolChoice = (
    Literal["none", "auto", "required"]
    | Annotated[ToolChoiceNamed | ToolChoiceAllowedTools, Field(discriminator="type")]
)


class JsonSchemaFormat(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    _check_schema = field_validator("schema_")(check_json_schema)


class ResponseFormatText(StrictModel):
    type: Literal["text"]


class ResponseFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]


class ChatStreamOptions(StrictModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # no obfuscation padding here: accepted, no-op


# -- the request ------------------------------------------------------------------------------


class ChatCompletionRequest(StrictModel):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ChatToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_OUTPUT_TOKENS)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_OUTPUT_TOKENS)  # deprecated name
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    stream: bool | None = None
    stream_options: ChatStreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None  # the official limit
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)  # choices (chat_choices.py)
    # Taken only at the values that change nothing (anything else: a 400 naming it).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    store: bool | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    # Extension, as on /v1/responses: most tokens of reasoning before the answer.
    reasoning_budget: int | None = Field(default=None, ge=0, le=(1 << 31) - 1)

    _check_metadata = field_validator("metadata")(check_metadata)


_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "store": (None, False),
    "modalities": (None, ["text"]),
}
_WHY = {
    "store": "chat completions are not stored (use /v1/responses with store: true)",
    "modalities": "only text is generated",
}


# Chat fields with the same name, meaning and values in a Responses request.
_PASSED_ON = ("parallel_tool_calls", "temperature", "top_p", "user", "service_tier",
              "safety_identifier", "prompt_cache_key", "metadata", "reasoning_budget")  # fmt: skip
# A tool call's input item's fields, as its chat message names them.
_CALL_FIELDS = {"call_id": "id", "name": "function.name", "arguments": "function.arguments"}

# -- the translation --------------------------------------------------------------------------


@dataclass
class Translation:
    """A chat request as a Responses request body, with where each of its input items came
    from (for error params): ``sources[i]`` is (the message's path, field renames)."""

    body: dict[str, Any]
    max_tokens: int | None
    sources: list[tuple[str, dict[str, str]]] = field(default_factory=list)


def to_responses(request: ChatCompletionRequest) -> Translation:
    """The Responses request that makes the same prompt and generation. Raises APIError for
    fields at values this server cannot honour."""
    _check_no_ops(request)
    translation = Translation(body={}, max_tokens=request.max_completion_tokens)
    if translation.max_tokens is None:
        translation.max_tokens = request.max_tokens
    for index, message in enumerate(request.messages):
        _add_message(translation, message, f"messages[{index}]")
    body = translation.body
    body.update(model=request.model, stream=False, store=False, input=body.pop("input", []))
    if request.tools:
        body["tools"] = [_tool(tool) for tool in request.tools]
    if request.tool_choice is not None:
        body["tool_choice"] = _tool_choice(request.tool_choice)
    for name in _PASSED_ON:
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    text: dict[str, Any] = {}
    if request.response_format is not None:
        text["format"] = _format(request.response_format)
    if request.verbosity is not None:
        text["verbosity"] = request.verbosity
    if text:
        body["text"] = text
    if request.reasoning_effort is not None:
        body["reasoning"] = {"effort": request.reasoning_effort}
    if request.logprobs:
        body["include"] = ["message.output_text.logprobs"]
        body["top_logprobs"] = request.top_logprobs or 0
    elif request.top_logprobs:
        raise bad_request("top_logprobs requires logprobs: true.", "top_logprobs")
    return translation


def _check_no_ops(request: ChatCompletionRequest) -> None:
    for name, allowed in _NO_OP_VALUES.items():
        value = getattr(request, name)
        if value not in allowed:
            why = _WHY.get(name, "only its default value is supported")
            raise bad_request(f"Unsupported value for '{name}': {why}.", name,
                              "unsupported_parameter")  # fmt: skip
    for index, message in enumerate(request.messages):
        if getattr(message, "name", None) is not None:
            raise bad_request("Participant names are not supported by this server.",
                              f"messages[{index}].name", "unsupported_parameter")  # fmt: skip


def _add_message(translation: Translation, message: Any, path: str) -> None:
    items = translation.body.setdefault("input", [])

    def add(item: dict[str, Any], where: str = path, renames: dict[str, str] | None = None):
        items.append(item)
        translation.sources.append((where, renames or {}))

    if isinstance(message, SystemMessage | UserMessage):
        add({"type": "message", "role": message.role, "content": text_of(message.content)})
    elif isinstance(message, ToolMessage):
        add({"type": "function_call_output", "call_id": message.tool_call_id,
             "output": text_of(message.content)}, renames={"call_id": "tool_call_id"})  # fmt: skip
    else:
        reasoning = message.reasoning_content or message.reasoning
        if reasoning:
            add({"type": "reasoning", "summary": [],
                 "content": [{"type": "reasoning_text", "text": reasoning}]})  # fmt: skip
        text = text_of(message.content) or (message.refusal or "")
        if message.tool_calls and text:  # the text before calls: a preamble (commentary)
            add({"type": "message", "role": "assistant", "content": text,
                 "phase": "commentary"})  # fmt: skip
        elif text or not message.tool_calls:
            add({"type": "message", "role": "assistant", "content": text})
        for number, call in enumerate(message.tool_calls or ()):
            add({"type": "function_call", "call_id": call.id, "name": call.function.name,
                 "arguments": call.function.arguments}, f"{path}.tool_calls[{number}]",
                _CALL_FIELDS)  # fmt: skip


def _tool(tool: ChatTool) -> dict[str, Any]:
    function = tool.function
    out: dict[str, Any] = {"type": "function", "name": function.name}
    for name in ("description", "parameters", "strict"):
        if getattr(function, name) is not None:
            out[name] = getattr(function, name)
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, ToolChoiceNamed):
        return {"type": "function", "name": choice.function.name}
    tools = [{"type": "function", "name": ref.function.name} for ref in choice.allowed_tools.tools]
    return {"type": "allowed_tools", "mode": choice.allowed_tools.mode, "tools": tools}


def _format(response_format: Any) -> dict[str, Any]:
    if not isinstance(response_format, ResponseFormatJsonSchema):
        return {"type": response_format.type}
    spec = response_format.json_schema
    out: dict[str, Any] = {"type": "json_schema", "name": spec.name,
                           "schema": spec.schema_ if spec.schema_ is not None else {}}  # fmt: skip
    if spec.description is not None:
        out["description"] = spec.description
    if spec.strict is not None:
        out["strict"] = spec.strict
    return out


# -- error params, back from the Responses request's to the chat request's ----------------------

_FIELDS = (  # (a Responses param's prefix, the chat request's), the first that matches
    (re.compile(r"^text\.format\.schema"), "response_format.json_schema.schema"),
    (re.compile(r"^text\.format"), "response_format"),
    (re.compile(r"^text\.verbosity"), "verbosity"),
    (re.compile(r"^tools\[(\d+)\]\.(?!type)"), r"tools[\1].function."),
    (re.compile(r"^tool_choice\.tools\[(\d+)\]\.name"),
     r"tool_choice.allowed_tools.tools[\1].function.name"),
    (re.compile(r"^tool_choice\.name"), "tool_choice.function.name"),
    (re.compile(r"^reasoning\.effort"), "reasoning_effort"),
    (re.compile(r"^input$"), "messages"),
)  # fmt: skip
_INPUT = re.compile(r"^input\[(\d+)\]\.?(\w*)(.*)$")


def chat_param(param: str | None, translation: Translation, max_tokens_name: str) -> str | None:
    """A Responses param (``input[3].call_id``) as the chat request's (``messages[2]
    .tool_call_id``)."""
    if param is None:
        return None
    if param == "max_output_tokens":
        return max_tokens_name
    found = _INPUT.match(param)
    if found is not None and int(found.group(1)) < len(translation.sources):
        where, renames = translation.sources[int(found.group(1))]
        key, rest = found.group(2), found.group(3)
        if not key:
            return where + rest
        return f"{where}.{renames.get(key, 'content' if key == 'output' else key)}{rest}"
    for pattern, replacement in _FIELDS:
        if pattern.match(param):
            return pattern.sub(replacement, param, count=1)
    return param
