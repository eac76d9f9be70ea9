"""vLLM's /tokenize and /detokenize over the control plane's Tokenize and Detokenize calls: a
prompt, or a chat rendered by the chat template (tools included), as token ids; token ids as
text, special tokens included."""

from __future__ import annotations

from gateway.chat_prompt import fill_chat
from gateway.errors import APIError
from gateway.schemas import DetokenizeResponse, TokenizeResponse
from gateway.serving import Gateway, name_template_param
from gateway.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from gateway.tools import tools_json
from protos.v1 import control_plane_pb2 as pb


def tokenize_request(body: TokenizeRequest) -> pb.TokenizeRequest:
    """The TokenizeRequest but for its model."""
    req = pb.TokenizeRequest(return_token_strs=bool(body.return_token_strs))
    if body.messages is not None:
        fill_chat(req.chat, body, tools_json(body.tools) if body.tools else "")
    else:
        assert body.prompt is not None
        req.text = body.prompt
        if body.add_special_tokens is not None:
            req.add_special_tokens = body.add_special_tokens
    return req


def detokenize_request(body: DetokenizeRequest) -> pb.DetokenizeRequest:
    """The DetokenizeRequest but for its model."""
    return pb.DetokenizeRequest(token_ids=body.tokens)


async def tokenize(gw: Gateway, body: TokenizeRequest, req: pb.TokenizeRequest) -> TokenizeResponse:
    _, req.model = await gw.model_names(body.model)
    try:
        resp = await gw.upstream_call(gw.upstream.tokenize(req))
    except APIError as err:
        name_template_param(err)
        raise
    return TokenizeResponse(
        count=len(resp.token_ids),
        max_model_len=resp.max_model_len,
        tokens=list(resp.token_ids),
        token_strs=list(resp.token_strs) if body.return_token_strs else None,
    )


async def detokenize(
    gw: Gateway, body: DetokenizeRequest, req: pb.DetokenizeRequest
) -> DetokenizeResponse:
    _, req.model = await gw.model_names(body.model)
    resp = await gw.upstream_call(gw.upstream.detokenize(req))
    return DetokenizeResponse(prompt=resp.text)
