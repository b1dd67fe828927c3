"""A request's tools as the functions the model may call: checked, and flattened.

A Responses request declares ``function`` tools, which the model calls as ``functions.{name}``
(Harmony's namespace for them), and ``namespace`` tools, whose functions it calls as
``{namespace}.{name}`` (each namespace is declared on its own in the developer message, its
description above its functions). ``tool_choice`` names top-level functions only, as the
SDK's ``ToolChoiceFunction`` and allowed-tools references carry no namespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gptoss_serve.harmony.conversation import FUNCTIONS, FunctionTool, ToolNamespace, recipient
from gptoss_serve.server.errors import bad_request
from gptoss_serve.server.protocol import (
    MAX_TOOLS,
    CreateResponseRequest,
    FunctionSpec,
    FunctionToolParam,
    ToolChoiceAllowed,
    ToolChoiceFunction,
    ToolParam,
)


@dataclass(frozen=True)
class DeclaredFunction:
    """One function of a request's tools, where the request declares it (``param``, e.g.
    ``tools[4].tools[0]``)."""

    spec: FunctionSpec
    namespace: str
    param: str

    @property
    def recipient(self) -> str:
        return recipient(self.namespace, self.spec.name)

    def as_tool(self) -> FunctionTool:
        spec = self.spec
        return FunctionTool(spec.name, spec.description, spec.parameters, bool(spec.strict),
                            self.namespace)  # fmt: skip


def declared_functions(tools: Sequence[ToolParam]) -> list[DeclaredFunction]:
    """Every function of ``tools`` in their order, a namespace's in its place."""
    functions = []
    for index, tool in enumerate(tools):
        if isinstance(tool, FunctionToolParam):
            functions.append(DeclaredFunction(tool, FUNCTIONS, f"tools[{index}]"))
            continue
        for position, inner in enumerate(tool.tools):
            param = f"tools[{index}].tools[{position}]"
            functions.append(DeclaredFunction(inner, tool.name, param))
    return functions


def checked_tools(
    request: CreateResponseRequest,
) -> tuple[tuple[FunctionTool, ...], tuple[ToolNamespace, ...]]:
    """The request's functions (each in its namespace) and its namespaces besides
    ``functions``. Raises a 400 naming the field for a name declared twice (a top-level
    function, a namespace, a function within its namespace), the reserved namespace name
    ``functions``, more than MAX_TOOLS functions, or a tool_choice naming no top-level
    function."""
    namespaces: list[ToolNamespace] = []
    for index, tool in enumerate(request.tools):
        if isinstance(tool, FunctionToolParam):
            continue
        if tool.name == FUNCTIONS:
            raise bad_request(f"The namespace name '{FUNCTIONS}' is reserved for the "
                              "top-level functions.", f"tools[{index}].name")  # fmt: skip
        if tool.name in {namespace.name for namespace in namespaces}:
            raise bad_request(f"Duplicate namespace name '{tool.name}'.", f"tools[{index}].name")
        namespaces.append(ToolNamespace(tool.name, tool.description))
    functions = declared_functions(request.tools)
    if len(functions) > MAX_TOOLS:
        raise bad_request(f"Too many functions: {len(functions)}, namespaces' included (at "
                          f"most {MAX_TOOLS}).", "tools")  # fmt: skip
    seen: set[tuple[str, str]] = set()
    for function in functions:
        key = (function.namespace, function.spec.name)
        if key in seen:
            where = "" if function.namespace == FUNCTIONS else f" in namespace '{key[0]}'"
            raise bad_request(f"Duplicate tool name '{key[1]}'{where}.", f"{function.param}.name")
        seen.add(key)
    _check_tool_choice(request, {name for namespace, name in seen if namespace == FUNCTIONS})
    return tuple(function.as_tool() for function in functions), tuple(namespaces)


def _check_tool_choice(request: CreateResponseRequest, top_level: set[str]) -> None:
    choice = request.tool_choice
    needs_tools = choice == "required" or isinstance(choice, ToolChoiceFunction | ToolChoiceAllowed)
    if needs_tools and not request.tools:
        raise bad_request("tool_choice requires at least one tool in 'tools'.", "tool_choice")
    if isinstance(choice, ToolChoiceFunction) and choice.name not in top_level:
        raise bad_request(f"Tool '{choice.name}' is not in 'tools'.", "tool_choice.name")
    if isinstance(choice, ToolChoiceAllowed):
        for index, ref in enumerate(choice.tools):
            if ref.name not in top_level:
                raise bad_request(f"Tool '{ref.name}' is not in 'tools'.",
                                  f"tool_choice.tools[{index}].name")  # fmt: skip
