"""A chat as the chat template renders it, shared by /v1/chat/completions and /tokenize: the
messages (text content parts joined), the tool calls of earlier turns, and the template's
extra variables, written into the control plane's `ChatPrompt`."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Protocol

from pydantic import Field

from gateway.errors import bad_request
from gateway.protocol import Body
from protos.v1 import control_plane_pb2 as pb

MAX_MESSAGES = 65536  # in one chat


class ContentPart(Body):
    type: Annotated[str, Field(max_length=64)]
    text: str | None = None


class CalledFunction(Body):
    name: Annotated[str, Field(max_length=512)]
    arguments: str  # JSON text, as OpenAI returns it


class MessageToolCall(Body):
    """A tool call of an earlier assistant turn, sent back with the conversation."""

    id: Annotated[str, Field(max_length=512)]
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=4096)] | None = None
    name: Annotated[str, Field(max_length=512)] | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=1024)] | None = None
    tool_call_id: Annotated[str, Field(max_length=512)] | None = None


def message_fields(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Each message as the control plane's ChatMessage takes it: role and text content, and
    where present its name, tool calls (JSON) and the tool call it answers."""
    out = []
    for (role, content), m in zip(message_texts(messages), messages, strict=True):
        fields = {"role": role, "content": content}
        if m.name is not None:
            fields["name"] = m.name
        if m.tool_calls:
            fields["tool_calls_json"] = json.dumps(
                [c.model_dump() for c in m.tool_calls], ensure_ascii=False
            )
        if m.tool_call_id is not None:
            fields["tool_call_id"] = m.tool_call_id
        out.append(fields)
    return out


def message_texts(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(role, content) pairs; text parts joined by newlines."""
    out: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        if m.content is None or isinstance(m.content, str):
            out.append((m.role, m.content or ""))
            continue
        texts = []
        for j, part in enumerate(m.content):
            param = f"messages.{i}.content.{j}"
            if part.type != "text":
                raise bad_request(
                    f"content parts of type {part.type!r} are not supported; send text",
                    f"{param}.type",
                )
            if part.text is None:
                raise bad_request("a text content part needs text", f"{param}.text")
            texts.append(part.text)
        out.append((m.role, "\n".join(texts)))
    return out


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


TemplateKwargs = Annotated[
    dict[str, Any] | None,
    Field(
        description="Extra variables for the chat template (vLLM's; e.g. a custom "
        "--chat-template's switches); not messages, tools or add_generation_prompt",
    ),
]


def template_kwargs_json(kwargs: dict[str, Any] | None) -> str:
    """chat_template_kwargs as ChatPrompt.chat_template_kwargs_json carries them."""
    return json.dumps(kwargs, ensure_ascii=False) if kwargs else ""


class ChatFields(Protocol):
    """What a body holding a chat carries beside its tools."""

    @property
    def messages(self) -> list[ChatMessage] | None: ...
    @property
    def add_generation_prompt(self) -> bool: ...
    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None: ...


def fill_chat(chat: pb.ChatPrompt, body: ChatFields, tools_json: str) -> None:
    """Writes the messages, and what the chat template renders beside them, into `chat`: in
    place and a message at a time, which keeps each protobuf call short (`gateway.bodies`:
    a long one stalls the event loop)."""
    assert body.messages is not None
    for fields in message_fields(body.messages):
        chat.messages.add(**fields)
    chat.add_generation_prompt = body.add_generation_prompt
    chat.tools_json = tools_json
    chat.chat_template_kwargs_json = template_kwargs_json(body.chat_template_kwargs)
