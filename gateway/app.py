"""The FastAPI app: OpenAI routes, vLLM's /tokenize, /detokenize and /version, /health and
/metrics over one control-plane channel."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from gateway.bodies import document_models, read_body, request_body_doc
from gateway.choices import (
    Budget,
    Choice,
    expand_choices,
    fill_chat,
    prompt_requests,
    sampling_proto,
    stream_choices,
)
from gateway.config import GatewayConfig
from gateway.errors import APIError, from_grpc, install_handlers
from gateway.generate import respond
from gateway.metrics import GatewayMetrics
from gateway.middleware import ApiKeyAuth, BodyLimit, HeadAsGet, RequestContext, request_id_of
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    tools_json,
)
from gateway.responses import ChatFormat, CompletionFormat, Format
from gateway.schemas import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    DetokenizeResponse,
    HealthStatus,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
    sse_response,
)
from gateway.tools import CallListParser, HermesParser, NamedCallParser, ToolCallParser
from gateway.upstream import Upstream
from pagedserve import __version__
from pagedserve.heap import freeze_heap
from pagedserve.log import get_logger
from pagedserve.sampling_params import DEFAULT_MAX_TOKENS
from pagedserve.wire import early_stopping_to_proto
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb

log = get_logger(__name__)

T = TypeVar("T")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in [
        (400, "Invalid request"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (429, "The control plane's queue is full; retry after Retry-After seconds"),
        (503, "The control plane is unavailable"),
    ]
}


class Gateway:
    """What the routes share: configuration, the upstream channel, metrics."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self._upstream: Upstream | None = None
        self._default_model: str | None = None
        self.started = int(time.time())  # the models' `created`
        self.budget = Budget(config.max_request_tokens, config.max_logprob_entries)

    @property
    def upstream(self) -> Upstream:
        assert self._upstream is not None, "the app's lifespan has not started"
        return self._upstream

    async def start(self) -> None:
        self._upstream = Upstream(
            self.config.control_plane,
            self.config.control_timeout_s,
            connect_wait_s=self.config.connect_wait_s,
            security=self.config.grpc_security,
        )

    async def stop(self) -> None:
        if self._upstream is not None:
            await self._upstream.close()

    async def models(self) -> list[pb.ModelInfo]:
        try:
            return await self.upstream.models()
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc, self.config.retry_after_s) from None

    async def model_names(self, requested: str | None) -> tuple[str, str]:
        """(the name clients see, the name sent upstream; "" lets the control plane choose)."""
        served = self.config.served_model_name
        if served is not None:
            if requested and requested != served:
                raise APIError(
                    404, f"model {requested!r} is not served here", code="model_not_found"
                )
            return served, ""
        if requested:
            return requested, requested  # an unknown name comes back as NOT_FOUND -> 404
        if self._default_model is None:
            models = await self.models()
            if not models:
                raise APIError(503, "the control plane serves no model", type="server_error")
            self._default_model = models[0].id
        return self._default_model, ""

    async def prompt_text(self, token_ids: Iterable[int]) -> str:
        """A token-id prompt as text (what `echo` shows)."""
        req = pb.DetokenizeRequest(token_ids=token_ids)
        resp = await self.upstream_call(self.upstream.detokenize(req))
        return resp.text

    async def prompt_length(self, text: str, add_special_tokens: bool) -> int:
        """A text prompt's token count, as Generate will see it."""
        req = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        resp = await self.upstream_call(self.upstream.tokenize(req))
        return len(resp.token_ids)

    async def upstream_call(self, call: Awaitable[T]) -> T:
        """A unary control-plane call, its gRPC errors mapped to HTTP ones."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc, self.config.retry_after_s) from None

    async def run(
        self, request: Request, body: SamplingFields, choices: list[Choice], fmt: Format
    ) -> Response:
        if not body.stream:  # one message per completion, not one per token
            for c in choices:
                c.request.output_kind = pb.OUTPUT_KIND_FINAL_ONLY
        events = stream_choices(
            self.upstream,
            choices,
            self.metrics,
            fmt.model,
            self.config.retry_after_s,
            self.config.stream_stall_timeout_s,
        )
        try:
            return await respond(
                request, events, choices, fmt, body.n, body.stream, body.include_usage
            )
        except APIError as err:
            _name_param(err, body)
            raise


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

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**_ERRORS, 200: sse_response(CompletionChunk)},
        openapi_extra=request_body_doc(CompletionRequest),
    )
    async def completions(request: Request) -> Response:
        parsed = await read_body(request, CompletionRequest, _checked(prompt_requests))
        body, prompts = parsed.body, parsed.prepared
        shown, upstream_model = await gw.model_names(body.model)
        rid = request_id_of(request.scope)
        sampling = sampling_proto(body, body.logprobs)
        _beam_search(body, sampling)
        if body.echo and body.logprobs is not None:  # the echoed prompt's tokens carry logprobs
            sampling.prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
        prompt_entries = 0  # every choice carries its prompt's logprobs
        if sampling.HasField("prompt_logprobs"):
            for prompt in prompts:
                count = (
                    len(prompt.token_ids.ids)
                    if prompt.HasField("token_ids")
                    else await gw.prompt_length(prompt.text, body.add_special_tokens)
                )
                prompt_entries += body.n * count * (1 + sampling.prompt_logprobs)
        gw.budget.check(
            len(prompts),
            body.n,
            body.max_tokens or DEFAULT_MAX_TOKENS,
            body.logprobs,
            prompt_entries,
        )
        single = len(prompts) == 1
        choices: list[Choice] = []
        echo: dict[int, str] = {}
        for i, base in enumerate(prompts):
            base.model = upstream_model
            base.sampling.CopyFrom(sampling)
            if body.echo:
                text = (
                    await gw.prompt_text(base.token_ids.ids)
                    if base.HasField("token_ids")
                    else base.text
                )
                echo.update(dict.fromkeys(range(i * body.n, (i + 1) * body.n), text))
            choices += expand_choices(base, body.n, i * body.n, rid, single)
        fmt = CompletionFormat(
            f"cmpl-{rid}", shown, body.logprobs, echo, body.n, body.prompt_logprobs
        )
        return await gw.run(request, body, choices, fmt)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_ERRORS, 200: sse_response(ChatCompletionChunk)},
        openapi_extra=request_body_doc(ChatCompletionRequest),
    )
    async def chat_completions(request: Request) -> Response:
        parsed = await read_body(request, ChatCompletionRequest, _checked(_chat_request))
        body, base = parsed.body, parsed.prepared
        shown, upstream_model = await gw.model_names(body.model)
        rid = request_id_of(request.scope)
        logprobs = body.logprobs_k()
        # The rendered prompt's logprobs come once, counted by the control plane.
        gw.budget.check(1, body.n, body.effective_max_tokens(), logprobs)
        sampling = sampling_proto(body, logprobs)
        _beam_search(body, sampling)
        base.model = upstream_model
        base.sampling.CopyFrom(sampling)
        choices = expand_choices(base, body.n, 0, rid, True)
        fmt = ChatFormat(
            f"chatcmpl-{rid}",
            shown,
            logprobs,
            body.n,
            body.prompt_logprobs,
            tool_parser=_tool_parser(body),
            head_content="" if body.tool_mode in (None, "auto") else None,
        )
        return await gw.run(request, body, choices, fmt)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models() -> ModelList:
        models = await gw.models()
        served = config.served_model_name
        data = [
            ModelCard(
                id=served or m.id, created=gw.started, root=m.id, max_model_len=m.max_model_len
            )
            for m in (models[:1] if served else models)
        ]
        return ModelList(data=data)

    @app.post(
        "/tokenize",
        response_model=TokenizeResponse,
        responses=_ERRORS,
        openapi_extra=request_body_doc(TokenizeRequest),
    )
    async def tokenize(request: Request) -> TokenizeResponse:
        """The prompt's token ids as a completion (`prompt`) or a chat (`messages`) sees them."""
        parsed = await read_body(request, TokenizeRequest, _checked(_tokenize_request))
        body, req = parsed.body, parsed.prepared
        _, req.model = await gw.model_names(body.model)
        try:
            resp = await gw.upstream_call(gw.upstream.tokenize(req))
        except APIError as err:
            first = err.message.split(" ", 1)[0].rstrip(":")
            if err.status == 400 and "render tools" in err.message:
                err.param = "tools"
            elif err.status == 400 and first in _TEMPLATE_FIELDS:
                err.param = first
            raise
        return TokenizeResponse(
            count=len(resp.token_ids),
            max_model_len=resp.max_model_len,
            tokens=list(resp.token_ids),
            token_strs=list(resp.token_strs) if body.return_token_strs else None,
        )

    @app.post(
        "/detokenize",
        response_model=DetokenizeResponse,
        responses=_ERRORS,
        openapi_extra=request_body_doc(DetokenizeRequest),
    )
    async def detokenize(request: Request) -> DetokenizeResponse:
        """The text of token ids, special tokens included."""
        parsed = await read_body(request, DetokenizeRequest, _detokenize_request)
        body, req = parsed.body, parsed.prepared
        _, req.model = await gw.model_names(body.model)
        resp = await gw.upstream_call(gw.upstream.detokenize(req))
        return DetokenizeResponse(prompt=resp.text)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/health", response_model=HealthStatus, responses={503: _ERRORS[503]})
    async def health() -> JSONResponse:
        """200 while the control plane serves and at least one worker is healthy."""
        if await gw.upstream.serving():
            return JSONResponse({"status": "ok"})
        return APIError(
            503, "the control plane or its workers are not serving", type="server_error"
        ).response()

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        try:
            snapshot: pb.StatsResponse | None = await gw.upstream.stats()
        except grpc.aio.AioRpcError:
            snapshot = None
        name = ""
        # Before a worker has registered the model is unknown, and asking would wait for one.
        if config.served_model_name is not None or (snapshot is not None and snapshot.workers):
            try:
                name, _ = await gw.model_names(None)
            except APIError:
                pass
        return Response(gw.metrics.render(snapshot, name), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            # Validation errors are 400 in OpenAI's shape here, never FastAPI's 422.
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            # The request bodies (which the routes read themselves, off the event loop when
            # large), and the stream events' shapes that the text/event-stream descriptions name.
            document_models(schema, [*_BODIES, CompletionChunk, ChatCompletionChunk])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _beam_search(body: SamplingFields, sampling: common_pb2.SamplingParams) -> None:
    """use_beam_search as the control plane takes it: the beam width beside n (the sequences
    returned), the length penalty and when to stop. Without it, those two are ignored."""
    if not body.use_beam_search:
        return
    sampling.beam_width = body.beam_width
    if body.length_penalty != 1.0:
        sampling.length_penalty = body.length_penalty
    sampling.early_stopping = early_stopping_to_proto(body.early_stopping)


def _tool_parser(body: ChatCompletionRequest) -> Callable[[], ToolCallParser] | None:
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


# The control plane's refusals start with the field they are about.
_CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Request fields the chat template renders beside the messages.
_TEMPLATE_FIELDS = ("tools", "chat_template_kwargs")


def _name_param(err: APIError, body: SamplingFields) -> None:
    """A control-plane 400 about the output constraint, logit_bias or tools names the request
    field it came from."""
    if err.status != 400 or err.param is not None:
        return
    first = err.message.split(" ", 1)[0].rstrip(":")
    constraint = body.output_constraint()
    if first in _CONSTRAINT_KINDS and constraint is not None:
        err.param = constraint.param
    elif first == "logit_bias":
        err.param = "logit_bias"
    elif "render tools" in err.message:
        err.param = "tools"
    elif first in _TEMPLATE_FIELDS:
        err.param = first


_BODIES = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
Checked = TypeVar("Checked", CompletionRequest, ChatCompletionRequest, TokenizeRequest)


def _checked(prepare: Callable[[Checked], T]) -> Callable[[Checked], T]:
    """`prepare` after the body's unknown fields are logged and its cross-field rules checked
    (`check()`, a 400), all where `read_body` runs it."""

    def run(body: Checked) -> T:
        _log_ignored(body)
        body.check()
        return prepare(body)

    return run


def _chat_request(body: ChatCompletionRequest) -> pb.GenerateRequest:
    """The chat's GenerateRequest but for its model and sampling."""
    req = pb.GenerateRequest()
    fill_chat(req.chat, body, body.tools_json())
    return req


def _tokenize_request(body: TokenizeRequest) -> pb.TokenizeRequest:
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


def _detokenize_request(body: DetokenizeRequest) -> pb.DetokenizeRequest:
    _log_ignored(body)
    return pb.DetokenizeRequest(token_ids=body.tokens)


def _log_ignored(body: Any) -> None:
    """Unknown fields are dropped, as vLLM does, with one line naming them."""
    ignored = body.ignored_fields()
    if ignored:
        log.warning("unknown_fields_ignored", fields=ignored)
