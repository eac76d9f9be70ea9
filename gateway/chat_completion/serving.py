"""/v1/chat/completions: the chat as one Generate call (its n choices forked by the control
plane), the request budget, and the response, its text parsed into tool calls when the
request's `tool_choice` asks for them."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response

from gateway.chat_completion.protocol import ChatCompletionRequest
from gateway.chat_prompt import fill_chat
from gateway.choices import expand_choices
from gateway.middleware import request_id_of
from gateway.responses import ChatFormat
from gateway.sampling import beam_search_proto, sampling_proto
from gateway.serving import Gateway
from gateway.tool_parsers import CallListParser, HermesParser, NamedCallParser, ToolCallParser
from protos.v1 import control_plane_pb2 as pb


def chat_request(body: ChatCompletionRequest) -> pb.GenerateRequest:
    """The chat's GenerateRequest but for its model and sampling."""
    req = pb.GenerateRequest()
    fill_chat(req.chat, body, body.tools_json())
    return req


def tool_parser(body: ChatCompletionRequest) -> Callable[[], ToolCallParser] | None:
    """How each choice's text becomes tool calls, for the request's tool_choice."""
    names = body.tool_names
    if body.tool_mode == "auto":
        return lambda: HermesParser(names)
    if body.tool_mode == "required":
        return lambda: CallListParser(names)
    name = body.named_tool
    if body.tool_mode == "function" and name is not None:
        return lambda: NamedCallParser(name)
    return None


async def create_chat_completion(
    gw: Gateway, request: Request, body: ChatCompletionRequest, base: pb.GenerateRequest
) -> Response:
    """The chat's completion (`base` is `chat_request` of the body), whole or streamed."""
    shown, upstream_model = await gw.model_names(body.model)
    rid = request_id_of(request.scope)
    logprobs = body.logprobs_k()
    # The rendered prompt's logprobs come once, counted by the control plane.
    gw.budget.check(1, body.n, body.effective_max_tokens(), logprobs)
    sampling = sampling_proto(body, logprobs)
    beam_search_proto(body, sampling)
    base.model = upstream_model
    base.sampling.CopyFrom(sampling)
    choices = expand_choices(base, body.n, 0, rid, True)
    fmt = ChatFormat(
        f"chatcmpl-{rid}",
        shown,
        logprobs,
        body.n,
        body.prompt_logprobs,
        tool_parser=tool_parser(body),
        head_content="" if body.tool_mode in (None, "auto") else None,
    )
    return await gw.run(request, body, choices, fmt)
