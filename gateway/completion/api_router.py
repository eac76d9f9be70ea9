"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.bodies import read_body
from gateway.completion.protocol import CompletionRequest
from gateway.completion.serving import create_completion, prompt_requests
from gateway.openapi import ERRORS, request_body_doc, sse_response
from gateway.schemas import CompletionChunk, CompletionResponse
from gateway.serving import gateway_of

router = APIRouter()


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={**ERRORS, 200: sse_response(CompletionChunk)},
    openapi_extra=request_body_doc(CompletionRequest),
)
async def completions(request: Request) -> Response:
    parsed = await read_body(request, CompletionRequest, prompt_requests)
    return await create_completion(gateway_of(request), request, parsed.body, parsed.prepared)
