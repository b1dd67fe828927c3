"""A request's guarantees as a grammar: tool_choice, text.format and the reasoning budget.

``constraint_grammar`` builds the ``ConstraintSpec`` of a request, checks every JSON Schema
it enforces (a schema the grammar library cannot express, or an invalid one, is a 400 whose
``param`` names it), and returns the grammar text that the engine's sampler follows. Every
compiled grammar is cached by its text, so the engine's matcher costs a copy.
"""

from __future__ import annotations

import logging
from typing import Any

from gptoss_serve.config import ServerConfig
from gptoss_serve.constrain import adapter
from gptoss_serve.constrain.grammar import (
    ANY_OBJECT,
    ConstraintSpec,
    ToolConstraint,
    build_grammar,
    schema_grammar,
)
from gptoss_serve.harmony.conversation import FUNCTIONS
from gptoss_serve.server.errors import bad_request
from gptoss_serve.server.protocol import (
    CreateResponseRequest,
    FunctionSpec,
    TextFormatJsonObject,
    TextFormatJsonSchema,
    ToolChoiceAllowed,
    ToolChoiceFunction,
)
from gptoss_serve.server.tools import declared_functions

logger = logging.getLogger(__name__)


def reasoning_budget(
    request: CreateResponseRequest, effort: str, max_tokens: int, config: ServerConfig
) -> int:
    """The request's own ``reasoning_budget`` as given; else the effort's default, capped at
    half of ``max_tokens`` so that the answer always has room."""
    if request.reasoning_budget is not None:
        return request.reasoning_budget
    return min(config.reasoning_budget(effort), max_tokens // 2)


def warm_up(config: ServerConfig) -> None:
    """Build the grammar library's tokenizer (the whole vocabulary: ~2 s, once a process) and
    compile a plain request's grammar at the default effort, before the first request would
    wait for them."""
    budget = config.reasoning_budget(config.reasoning_effort)
    adapter.check_grammar(build_grammar(ConstraintSpec(reasoning_budget=budget)))


def constraint_grammar(request: CreateResponseRequest, budget: int) -> str:
    """The grammar of this request's answer; raises a 400 APIError for a bad schema."""
    spec = constraint_spec(request, budget)
    for schema, param in _enforced_schemas(request, spec):
        _check_schema(schema, param)
    grammar = build_grammar(spec)
    adapter.check_grammar(grammar)  # each part compiled above: a failure here is our bug
    return grammar


def constraint_spec(request: CreateResponseRequest, budget: int) -> ConstraintSpec:
    """tool_choice and text.format as a ConstraintSpec (the tool names are already checked:
    tool_choice names top-level functions)."""
    choice = request.tool_choice
    functions = declared_functions(request.tools)
    require_call = choice == "required"
    if choice == "none":
        functions = []
    elif isinstance(choice, ToolChoiceFunction):
        functions = [
            f for f in functions if f.namespace == FUNCTIONS and f.spec.name == choice.name
        ]
        require_call = True
    elif isinstance(choice, ToolChoiceAllowed):
        listed = {ref.name for ref in choice.tools}
        functions = [f for f in functions if f.namespace == FUNCTIONS and f.spec.name in listed]
        require_call = choice.mode == "required"
    tools = tuple(
        ToolConstraint(f.spec.name, _arguments_schema(f.spec, require_call), f.namespace)
        for f in functions
    )
    response_schema = _response_schema(request)
    return ConstraintSpec(
        tools=tools,
        require_call=require_call,
        response_schema=response_schema,
        reasoning_budget=budget,
        # A plain response reasons first, as gpt-oss does; with a JSON format or a forced
        # call the answer may also come first and is held to the format either way.
        require_reasoning=response_schema is None and not require_call,
    )


def _arguments_schema(tool: FunctionSpec, is_forced: bool) -> dict[str, Any]:
    """A strict tool's arguments always match its parameters, and so do a forced call's;
    otherwise they are any JSON object."""
    if (tool.strict or is_forced) and tool.parameters is not None:
        return tool.parameters
    return ANY_OBJECT


def _response_schema(request: CreateResponseRequest) -> dict[str, Any] | None:
    fmt = request.text.format
    if isinstance(fmt, TextFormatJsonSchema):
        return fmt.schema_
    if isinstance(fmt, TextFormatJsonObject):
        return ANY_OBJECT
    return None


def _enforced_schemas(
    request: CreateResponseRequest, spec: ConstraintSpec
) -> list[tuple[dict[str, Any], str]]:
    """(schema, param) of every schema the grammar enforces, and of every strict tool's
    parameters even when this request cannot call it (a strict schema is always checked)."""
    schemas = []
    if isinstance(request.text.format, TextFormatJsonSchema):
        schemas.append((request.text.format.schema_, "text.format.schema"))
    enforced = {tool.recipient for tool in spec.tools if tool.parameters is not ANY_OBJECT}
    for function in declared_functions(request.tools):
        tool = function.spec
        if tool.parameters is not None and (tool.strict or function.recipient in enforced):
            schemas.append((tool.parameters, f"{function.param}.parameters"))
    return schemas


# The real API's limit on enum values across an enforced schema. The grammar library's masks
# grow with them: a strict format of one 6,000-value enum took 45 s and 3 GB to generate 16
# tokens on the CPU demo, 20,000 values over 10 GB.
MAX_ENUM_VALUES = 1000


def _enum_values(value: Any) -> int:
    """The values of every ``enum`` list in a schema, at any depth."""
    if isinstance(value, list):
        return sum(_enum_values(item) for item in value)
    if not isinstance(value, dict):
        return 0
    listed = value.get("enum")
    own = len(listed) if isinstance(listed, list) else 0
    return own + sum(_enum_values(item) for item in value.values())


def _check_schema(schema: dict[str, Any], param: str) -> None:
    values = _enum_values(schema)
    if values > MAX_ENUM_VALUES:
        raise bad_request(
            f"Invalid schema: it has {values} enum values in all, more than the "
            f"{MAX_ENUM_VALUES} an enforced schema may have.", param, "invalid_json_schema",
        )  # fmt: skip
    try:
        adapter.check_grammar(schema_grammar(schema))
    except adapter.GrammarError as error:
        raise bad_request(
            f"Invalid or unsupported JSON Schema: {error} (supported keywords: see "
            "docs/constrained-decoding.md).", param, "invalid_json_schema",
        ) from error  # fmt: skip
