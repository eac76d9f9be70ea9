"""vLLM's /tokenize and /detokenize bodies."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gateway.chat_prompt import MAX_MESSAGES, Messages, TemplateKwargs, message_texts
from gateway.errors import bad_request
from gateway.protocol import MAX_PROMPT_TOKEN_IDS, ModelName, RequestBody, TokenId
from gateway.tools import Tools, check_tools


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: a `prompt`, or `messages` rendered with the chat template."""

    MAX_COUNTS = {"messages": (MAX_MESSAGES, "messages")}

    model: ModelName | None = None
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Messages | None = None
    # Default: true for a prompt, false for messages (the chat template writes its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: TemplateKwargs = None
    tools: Tools | None = Field(
        None, description='With messages: rendered by the chat template, as chat\'s "auto"'
    )

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send either prompt or messages", "prompt")
        if self.messages is None:
            if self.tools:
                raise bad_request("tools go with messages, not a prompt", "tools")
            return
        for name in ("continue_final_message", "chat_template"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported", name)
        check_tools(self.tools or [])
        if self.add_special_tokens:
            raise bad_request(
                "add_special_tokens with messages is not supported: the chat template writes "
                "the special tokens",
                "add_special_tokens",
            )
        message_texts(self.messages)


class DetokenizeRequest(RequestBody):
    MAX_COUNTS = {"tokens": (MAX_PROMPT_TOKEN_IDS, "token ids")}

    model: ModelName | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKEN_IDS)]
