"""Response-side objects (pydantic), shaped exactly like the official API's.

They are the ``response_model`` of the routes, so the published OpenAPI schema is accurate,
and the tests validate every one against the ``openai`` SDK's own types.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from gptoss_serve.server.protocol import (
    ReasoningConfig,
    TextConfig,
    ToolChoice,
    ToolParam,
)

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    """``resp_``, ``msg_``, ``rs_``, ``fc_``, ``call_`` ids: prefix + 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


class OutputTextPart(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextPart] = Field(default_factory=list)
    # With include reasoning.encrypted_content (server/reasoning_seal.py), else null.
    encrypted_content: str | None = None
    status: ItemStatus = "completed"


class MessageOutput(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputTextPart] = Field(default_factory=list)
    # A Harmony commentary message without recipient is a preamble ("commentary"); the
    # answer is "final_answer". Clients resend it, so a follow-up replays the right channel.
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallOutputObject(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    # The `namespace` tool the function belongs to; absent for a top-level function.
    namespace: str | None = None
    arguments: str
    status: ItemStatus = "completed"

    @model_serializer(mode="wrap")
    def _without_null_namespace(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> dict[str, Any]:
        del info
        data = handler(self)
        if data.get("namespace") is None:
            data.pop("namespace", None)
        return data


class CompactionOutput(BaseModel):
    """The summary a response made of its conversation before answering (``context_management``,
    server/compaction.py), first in its output: the items before it, but the user and
    system/developer messages, are then out of the prompt (harmony/render.py)."""

    type: Literal["compaction"] = "compaction"
    id: str
    encrypted_content: str


OutputItem = Annotated[
    ReasoningOutput | MessageOutput | FunctionCallOutputObject | CompactionOutput,
    Field(discriminator="type"),
]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (none on CPU)
    cache_write_tokens: int = 0  # prompt tokens written to a prompt cache (none kept yet)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ConversationRefObject(BaseModel):
    id: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress", "queued", "cancelled"]
    background: bool = False
    completed_at: int | None = None  # set when the status becomes `completed`, as the API does
    conversation: ConversationRefObject | None = None  # the one its items were added to
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    reasoning: ReasoningConfig = Field(default_factory=ReasoningConfig)
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool = True
    temperature: float | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    tool_choice: ToolChoice = "auto"
    tools: list[ToolParam] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: Usage | None = None
    user: str | None = None

    def dump(self) -> dict[str, Any]:
        """The JSON object sent to clients (``schema`` keeps its wire name)."""
        return self.model_dump(mode="json", by_alias=True)


class InputTokenCount(BaseModel):
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class CompactedResponseObject(BaseModel):
    """``POST /v1/responses/compact``'s answer: the conversation's user messages, then one
    ``compaction`` item (server/compaction.py)."""

    id: str
    object: Literal["response.compaction"] = "response.compaction"
    created_at: int
    output: list[dict[str, Any]]
    usage: Usage


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def page(cls, data: list[dict[str, Any]], has_more: bool) -> Self:
        """A page of items, with the ids of its first and last (None for an empty page)."""
        first_id, last_id = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return cls(data=data, first_id=first_id, last_id=last_id, has_more=has_more)


class ConversationObject(BaseModel):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedConversation(BaseModel):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: Literal[True] = True


class ConversationItemList(InputItemList):
    """A page of a conversation's items (the same list object as input_items')."""


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gptoss-serve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody
