"""Tool calling's request side: OpenAI's function tools and `tool_choice` as the bodies take
them, their checks (unique names, parameters that are JSON schemas), the tools as the chat
template reads them, and the schema that constrains `tool_choice: "required"`. The parsers that
turn the output back into tool calls are `gateway.tool_parsers`."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.errors import bad_request
from gateway.json_schema import rebase_refs, schema_text
from gateway.protocol import Body

# OpenAI's rule for function names.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def required_schema(
    tools: list[tuple[str, dict[str, Any]]], parallel: bool = True
) -> dict[str, Any]:
    """`tool_choice: "required"`: a JSON array of one or more calls (one without
    `parallel`), each `{"name": <a tool's name>, "parameters": <that tool's schema>}`."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": rebase_refs(parameters, f"#/items/anyOf/{i}/properties/parameters"),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, (name, parameters) in enumerate(tools)
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class FunctionDefinition(Body):
    name: Annotated[
        str,
        Field(
            pattern=f"^{TOOL_NAME.pattern}$",
            description="1 to 64 letters, digits, underscores or dashes; unique among the tools",
        ),
    ]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="The arguments' JSON schema; none: the function takes no arguments"
    )
    strict: bool | None = Field(
        None, description="Accepted; calls a tool_choice forces always follow the schema"
    )

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS

    def as_tool(self) -> dict[str, Any]:
        """The definition as a chat template reads it (`tools` of apply_chat_template)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters_schema
        return {"type": "function", "function": fn}


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[Tool], Field(max_length=128)]


def check_tools(tools: list[Tool]) -> None:
    """Unique names, and parameters that are JSON schemas."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in seen:
            raise bad_request(
                f"tools {seen[fn.name]} and {i} are both called {fn.name!r}; names must be unique",
                f"tools.{i}.function.name",
            )
        seen[fn.name] = i
        if fn.parameters is not None:
            schema_text(fn.parameters, f"tools.{i}.function.parameters")


def tools_json(tools: list[Tool]) -> str:
    """The tools as the chat template reads them (ChatPrompt.tools_json)."""
    return json.dumps([t.function.as_tool() for t in tools], ensure_ascii=False)
