"""POST /tokenize and POST /detokenize (vLLM's)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.bodies import read_body
from gateway.openapi import ERRORS, request_body_doc
from gateway.schemas import DetokenizeResponse, TokenizeResponse
from gateway.serving import gateway_of
from gateway.tokenize import serving
from gateway.tokenize.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    responses=ERRORS,
    openapi_extra=request_body_doc(TokenizeRequest),
)
async def tokenize(request: Request) -> TokenizeResponse:
    """The prompt's token ids as a completion (`prompt`) or a chat (`messages`) sees them."""
    parsed = await read_body(request, TokenizeRequest, serving.tokenize_request)
    return await serving.tokenize(gateway_of(request), parsed.body, parsed.prepared)


@router.post(
    "/detokenize",
    response_model=DetokenizeResponse,
    responses=ERRORS,
    openapi_extra=request_body_doc(DetokenizeRequest),
)
async def detokenize(request: Request) -> DetokenizeResponse:
    """The text of token ids, special tokens included."""
    parsed = await read_body(request, DetokenizeRequest, serving.detokenize_request)
    return await serving.detokenize(gateway_of(request), parsed.body, parsed.prepared)
