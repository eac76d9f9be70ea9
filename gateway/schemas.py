"""The 200 responses' shapes, for the OpenAPI schema and for the routes that build them.

The generation routes build their bodies as plain dicts (`gateway.responses`, one code path for
whole and streamed answers); the models here describe those bodies and are checked against them
in the tests. Fields beyond OpenAI's (`stop_reason`, `max_model_len`, `root`) are vLLM's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

StopReason = int | str | None  # a stop token id, a stop string, or null (EOS, length)

CHOICE_INDEX = (
    "i of n, or prompt index x n + i for a batch of prompts; with `use_beam_search`, a "
    "prompt's n sequences by score, the best first (i = 0)"
)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = Field(
        description="Over the returned choices (with `use_beam_search`, the n sequences "
        "returned, not every beam searched)"
    )
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """With echo, the prompt's tokens come first; the first has no logprob (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int = Field(description="1 = the likeliest token at that position")
    decoded_token: str


# Per prompt token: null for the first, else the token and its top alternatives by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = Field(description=CHOICE_INDEX)
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: StopReason = Field(
        description="The stop token id (an integer) or stop string that ended the completion; "
        "null when it ended at EOS or length"
    )
    prompt_logprobs: PromptLogprobs | None = Field(
        None, description="With `prompt_logprobs` (vLLM's parameter), not streamed"
    )


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion; the usage event has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments, as JSON text")


class ToolCall(BaseModel):
    id: str = Field(description="`call_` and 24 random hex digits")
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(
        description="The text; with tool calls, the text around them, null when there is none"
    )
    tool_calls: list[ToolCall] | None = Field(
        None, description="With `tools`: the calls the model made; absent when it made none"
    )


FINISH_REASON = (
    '"stop" (EOS or a stop condition), "length" (max_tokens or the context), or "tool_calls" '
    "(the choice made tool calls and ended by itself)"
)


class ChatChoice(BaseModel):
    index: int = Field(description=CHOICE_INDEX)
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None = Field(description=FINISH_REASON)
    stop_reason: StopReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(
        None, description="With `prompt_logprobs` (vLLM's parameter): of the rendered prompt"
    )


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, description="In the call's first delta")
    arguments: str | None = Field(None, description="The next piece of the arguments' text")


class ToolCallDelta(BaseModel):
    index: int = Field(description="The call's place among the choice's calls")
    id: str | None = Field(None, description="In the call's first delta")
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None = Field(description=FINISH_REASON)
    stop_reason: StopReason = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion; the usage event has no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time at which the gateway started serving it")
    owned_by: str = "pagedserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthStatus(BaseModel):
    status: Literal["ok"]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
