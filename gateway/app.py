"""The FastAPI app: OpenAI routes, vLLM's /tokenize, /detokenize and /version, /health and
/metrics over one control-plane channel. One router per endpoint (`<endpoint>/api_router.py`),
its handler a thin call into the endpoint's serving module; what they share is the app's
`Gateway` (`gateway.serving`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.chat_completion import api_router as chat_completion
from gateway.chat_completion.protocol import ChatCompletionRequest
from gateway.completion import api_router as completion
from gateway.completion.protocol import CompletionRequest
from gateway.config import GatewayConfig
from gateway.errors import install_handlers
from gateway.middleware import ApiKeyAuth, BodyLimit, HeadAsGet, RequestContext
from gateway.models import api_router as models
from gateway.openapi import install_openapi
from gateway.probes import api_router as probes
from gateway.schemas import ChatCompletionChunk, CompletionChunk
from gateway.serving import Gateway
from gateway.tokenize import api_router as tokenize
from gateway.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from pagedserve.heap import freeze_heap
from pagedserve.log import get_logger

log = get_logger(__name__)


def create_app(config: GatewayConfig) -> FastAPI:
    gw = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        log.info("gateway_ready", frozen_objects=freeze_heap())
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(
        title="pagedserve",
        summary="OpenAI-compatible API over the pagedserve control plane",
        version="1",
        lifespan=lifespan,
        strict_content_type=False,  # a body without Content-Type is read as JSON
    )
    app.state.gateway = gw
    install_handlers(app)
    # Starlette wraps in reverse: the last added runs first.
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(ApiKeyAuth, api_key=config.api_key)
    app.add_middleware(HeadAsGet)
    app.add_middleware(RequestContext)
    for router in (completion, chat_completion, models, tokenize, probes):
        app.include_router(router.router)
    install_openapi(
        app,
        [
            CompletionRequest,
            ChatCompletionRequest,
            TokenizeRequest,
            DetokenizeRequest,
            CompletionChunk,
            ChatCompletionChunk,
        ],
    )
    return app
