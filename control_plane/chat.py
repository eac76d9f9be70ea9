"""Chat prompts: the checkpoint's jinja chat template, rendered the way transformers does
(sandboxed, trim_blocks + lstrip_blocks, `raise_exception` and `tojson` available), and where
the messages' contents lie in the rendering (`content_spans`): the tokenizer reads special-token
text there as plain text, so a user typing `<|im_end|>` does not end their turn."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedserve.json_values import check_json_value
from pagedserve.sampling_params import InvalidRequestError

# A message's content while locating contents: noncharacters no template writes itself.
_MARK = re.compile("\ufdd3([0-9]+)\ufdd4")
# Variables render_chat sets from fields of their own: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})
# What a template may raise on messages it cannot render (a sandboxed template cannot reach
# anything that raises more): a 400 for the request, not a failure of the server.
_RENDER_ERRORS = (TemplateError, TypeError, ValueError, LookupError, ArithmeticError)


def _raise(message: str) -> None:
    raise InvalidRequestError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def check_template(template: str) -> None:
    """Raises ValueError, naming the line, if `template` is not a jinja template."""
    try:
        _compile(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not parse: line {exc.lineno}: {exc}") from None


def parse_template_kwargs(kwargs_json: str) -> dict[str, Any]:
    """A chat's chat_template_kwargs (extra template variables) from their JSON object; the
    variables render_chat sets itself are refused."""
    try:
        kwargs = json.loads(kwargs_json)
    except RecursionError:
        raise InvalidRequestError("chat_template_kwargs: nested too deeply") from None
    except ValueError as exc:
        raise InvalidRequestError(f"chat_template_kwargs: not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs: must be a JSON object")
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(kwargs))
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs: must not set {', '.join(reserved)}: the request's own fields do"
        )
    return kwargs


def parse_tools(tools_json: str) -> list[dict[str, Any]]:
    """A chat's tools (OpenAI function definitions) from their JSON list."""
    try:
        tools = json.loads(tools_json)
    except ValueError as exc:
        raise InvalidRequestError(f"tools_json is not valid JSON: {exc}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequestError("tools_json must be a JSON list of objects")
    return tools


def template_message(m: Any) -> dict[str, Any]:
    """A ChatMessage as chat templates read it: role and content, and where set its name, the
    tool call it answers (`tool_call_id`) and its tool calls, each call's `arguments` the
    object its JSON holds (kept as text when it holds no object), as transformers' templates
    expect."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls_json:
        try:
            calls = json.loads(m.tool_calls_json)
        except RecursionError:
            raise InvalidRequestError("tool_calls_json is nested too deeply") from None
        except ValueError as exc:
            raise InvalidRequestError(f"tool_calls_json is not valid JSON: {exc}") from None
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise InvalidRequestError("tool_calls_json must be a JSON list of objects")
        for call in calls:
            function = call.get("function")
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    arguments = json.loads(function["arguments"])
                    check_json_value(arguments)  # the template renders it recursively
                except (ValueError, RecursionError):
                    continue  # passed to the template as the text it is
                if isinstance(arguments, dict):
                    call["function"] = {**function, "arguments": arguments}
        out["tool_calls"] = calls
    return out


def render_chat(
    template: str | None,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    variables: dict[str, Any],
) -> str:
    """The template rendered over the messages; `variables` are the special tokens' texts,
    the chat's template kwargs, and `tools` when the chat has tools (refused if the template
    renders none). A template that fails on these messages is the request's error."""
    if template is None:
        raise InvalidRequestError("this model has no chat template; send a plain prompt")
    if not messages:
        raise InvalidRequestError("messages must not be empty")
    if "tools" in variables and not re.search(r"\btools\b", template):
        raise InvalidRequestError(
            "this model's chat template does not render tools, so tool_choice 'auto' cannot "
            "offer them; use tool_choice 'required' or a named function"
        )
    try:
        text: str = _compile(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except _RENDER_ERRORS as exc:
        raise InvalidRequestError(f"the chat template failed on these messages: {exc}") from exc
    return text


def content_spans(
    template: str,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    variables: dict[str, Any],
    text: str,
) -> list[tuple[int, int]] | None:
    """The [start, end) character ranges of `text` (render_chat's output for these messages)
    that are message content, in order. The template is rendered again with each content
    replaced by a mark, and that rendering is walked along `text`: the template's own text
    must match exactly, and each mark stands for the content whole or trimmed (`| trim`).
    None when the template does anything else to content (splits it, drops part of it)."""
    marked = [{**m, "content": f"\ufdd3{i}\ufdd4"} for i, m in enumerate(messages)]
    try:
        rendered: str = _compile(template).render(
            messages=marked, add_generation_prompt=add_generation_prompt, **variables
        )
    except (*_RENDER_ERRORS, InvalidRequestError):
        return None
    parts = _MARK.split(rendered)  # template text, message index, template text, ...
    spans: list[tuple[int, int]] = []
    pos = 0
    for k in range(0, len(parts), 2):
        if not text.startswith(parts[k], pos):
            return None
        pos += len(parts[k])
        if k + 1 == len(parts):
            break
        content = messages[int(parts[k + 1])]["content"]
        after = parts[k + 2]
        for candidate in (content, content.strip()):
            if text.startswith(candidate, pos) and text.startswith(after, pos + len(candidate)):
                break
        else:
            return None
        spans.append((pos, pos + len(candidate)))
        pos += len(candidate)
    return spans if pos == len(text) else None
