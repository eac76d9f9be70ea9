"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.bodies import read_body
from gateway.chat_completion.protocol import ChatCompletionRequest
from gateway.chat_completion.serving import chat_request, create_chat_completion
from gateway.openapi import ERRORS, request_body_doc, sse_response
from gateway.schemas import ChatCompletionChunk, ChatCompletionResponse
from gateway.serving import gateway_of

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**ERRORS, 200: sse_response(ChatCompletionChunk)},
    openapi_extra=request_body_doc(ChatCompletionRequest),
)
async def chat_completions(request: Request) -> Response:
    parsed = await read_body(request, ChatCompletionRequest, chat_request)
    return await create_chat_completion(gateway_of(request), request, parsed.body, parsed.prepared)
