"""The /v1/chat/completions body: OpenAI's chat completions, tools included, with vLLM's
extensions."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.chat_prompt import MAX_MESSAGES, Messages, TemplateKwargs, message_texts
from gateway.errors import bad_request
from gateway.json_schema import compact_json
from gateway.protocol import INTEGRAL, bounded
from gateway.sampling import SamplingFields
from gateway.structured_output import Constraint
from gateway.tools import (
    NamedToolChoice,
    ToolChoice,
    Tools,
    check_tools,
    required_schema,
    tools_json,
)


class ChatCompletionRequest(SamplingFields):
    MAX_COUNTS = {"messages": (MAX_MESSAGES, "messages")}

    messages: Messages
    max_completion_tokens: Annotated[int, bounded("max_tokens"), INTEGRAL] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, bounded("logprobs"), INTEGRAL] | None = None
    add_generation_prompt: bool = True
    tools: Tools | None = Field(
        None, description="Functions the model may call (OpenAI's function tools)"
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description='"auto" (the default with tools): the chat template shows the tools and '
        'the calls the model writes come back as tool_calls; "required": the output is one '
        'or more calls of the tools; {"type": "function", "function": {"name"}}: the output '
        'is that function\'s arguments; "none": the tools are left out',
    )
    parallel_tool_calls: bool = Field(True, description='false: "required" makes exactly one call')
    chat_template_kwargs: TemplateKwargs = None

    def effective_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        """Alternatives per token to ask the control plane for, or None for no logprobs."""
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def message_texts(self) -> list[tuple[str, str]]:
        return message_texts(self.messages)

    def beam_search_conflicts(self) -> list[tuple[str, Any]]:
        out = super().beam_search_conflicts()
        if self.logprobs:
            out.append(("logprobs", self.logprobs))
        return out

    def check(self) -> None:
        self._check_tools()
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self.message_texts()

    def _check_tools(self) -> None:
        if self.tool_choice is not None and not self.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        check_tools(self.tools or [])
        named = self.named_tool
        if named is not None and named not in self.tool_names:
            raise bad_request(
                f"tool_choice names function {named!r}, which is not among the tools",
                "tool_choice.function.name",
            )

    @property
    def tool_mode(self) -> Literal["auto", "required", "function"] | None:
        """None without tools or with tool_choice "none"; "function" for a named one."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice is None:
            return "auto"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        return self.tool_choice

    @property
    def named_tool(self) -> str | None:
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return None

    @property
    def tool_names(self) -> set[str]:
        return {t.function.name for t in self.tools or []}

    def tools_json(self) -> str:
        """The tools for the chat template: only with tool_choice "auto"."""
        if self.tool_mode != "auto":
            return ""
        assert self.tools is not None
        return tools_json(self.tools)

    def constraints(self) -> list[Constraint]:
        out = super().constraints()
        mode = self.tool_mode
        if mode == "required":
            assert self.tools is not None
            tools = [(t.function.name, t.function.parameters_schema) for t in self.tools]
            schema = required_schema(tools, self.parallel_tool_calls)
            spec = compact_json(schema)
            out.append(Constraint("tool_choice", "json_schema", spec))
        elif mode == "function":
            [fn] = [t.function for t in self.tools or [] if t.function.name == self.named_tool]
            spec = compact_json(fn.parameters_schema)
            out.append(Constraint("tool_choice", "json_schema", spec))
        return out
