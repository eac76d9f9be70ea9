"""What every endpoint's serving module shares (`Gateway`, one per app): the configuration,
the control-plane channel, the metrics, the model name clients see, unary calls with their
gRPC errors mapped, and running a generation request's choices to its response."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Iterable
from typing import TypeVar

import grpc
from fastapi import Request
from fastapi.responses import Response

from gateway.choices import Budget, Choice, stream_choices
from gateway.config import GatewayConfig
from gateway.errors import APIError, from_grpc
from gateway.generate import respond
from gateway.metrics import GatewayMetrics
from gateway.responses import Format
from gateway.sampling import SamplingFields
from gateway.upstream import Upstream
from protos.v1 import control_plane_pb2 as pb

T = TypeVar("T")

# The control plane's refusals start with the field they are about.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Request fields the chat template renders beside the messages.
TEMPLATE_FIELDS = ("tools", "chat_template_kwargs")


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
        """The choices' Generate calls, answered whole or streamed as the body asks."""
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


def gateway_of(request: Request) -> Gateway:
    """The app's `Gateway`, for a route's handler."""
    gw = request.app.state.gateway
    assert isinstance(gw, Gateway)
    return gw


def name_template_param(err: APIError) -> None:
    """A control-plane 400 about what the chat template renders beside the messages names
    the request field it came from."""
    if err.status != 400 or err.param is not None:
        return
    first = err.message.split(" ", 1)[0].rstrip(":")
    if "render tools" in err.message:
        err.param = "tools"
    elif first in TEMPLATE_FIELDS:
        err.param = first


def _name_param(err: APIError, body: SamplingFields) -> None:
    """A control-plane 400 about the output constraint, logit_bias or tools names the request
    field it came from."""
    if err.status != 400 or err.param is not None:
        return
    first = err.message.split(" ", 1)[0].rstrip(":")
    constraint = body.output_constraint()
    if first in CONSTRAINT_KINDS and constraint is not None:
        err.param = constraint.param
    elif first == "logit_bias":
        err.param = "logit_bias"
    else:
        name_template_param(err)
