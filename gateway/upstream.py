"""The gateway's only link to the control plane: one grpc.aio channel and its calls.

The channel notices a control plane that stops answering (keepalive pings with a short
timeout: in-flight calls fail UNAVAILABLE within KEEPALIVE_S + PING_TIMEOUT_S) and reconnects
to one that comes back within about a second (a capped reconnect back-off; gRPC's default
grows to 120 s). A new call waits at most `connect_wait_s` for the channel to be ready, so
that it neither hangs on a dead control plane nor fails in the moment between the control
plane coming back and the channel's next connection attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.grpc_security import INSECURE, GrpcSecurity, aio_channel
from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc

# The control plane's max_receive_message_length: a larger request is refused by gRPC before
# it is sent (RESOURCE_EXHAUSTED, which gateway.errors maps to 413).
MAX_REQUEST_MESSAGE = 16 << 20
KEEPALIVE_S = 3.0
PING_TIMEOUT_S = 2.0

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 128 << 20),  # a final-only completion is one message
    ("grpc.max_send_message_length", MAX_REQUEST_MESSAGE),
    # A stopped control plane still holds its TCP connections open: only an unanswered ping
    # shows it. The control plane accepts a ping every few seconds, with or without calls.
    ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(PING_TIMEOUT_S * 1000)),
    ("grpc.http2.ping_timeout_ms", int(PING_TIMEOUT_S * 1000)),  # gRPC's default is 60 s
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect attempts 0.2 s apart growing to 1 s; one attempt gives up after 1 s (a stopped
    # control plane accepts TCP connections but never completes the HTTP/2 handshake).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 1_000),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


def unavailable(details: str) -> grpc.aio.AioRpcError:
    """The error a call to an unreachable control plane fails with."""
    empty = grpc.aio.Metadata()
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, empty, empty, details)


class GenerateStream:
    """One Generate call, started once the channel is ready: iterate for the messages (a
    control plane that stays unreachable raises UNAVAILABLE), cancel to abort it upstream."""

    def __init__(self, upstream: Upstream, request: pb.GenerateRequest) -> None:
        self._upstream = upstream
        self._request = request
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._cancelled = False

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[pb.GenerateResponse]:
        await self._upstream.connected()
        if self._cancelled:
            return
        self._call = self._upstream.stub.Generate(self._request)
        async for msg in self._call:
            yield msg

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()


class Upstream:
    """ControlPlane and grpc.health.v1 stubs over one channel. Create it inside the event
    loop that will use it (grpc.aio binds the channel to the running loop)."""

    def __init__(
        self,
        address: str,
        timeout_s: float,
        *,
        connect_wait_s: float = 0.5,
        security: GrpcSecurity = INSECURE,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.connect_wait_s = connect_wait_s
        self.channel = aio_channel(address, security, _CHANNEL_OPTIONS)
        self.stub = pb_grpc.ControlPlaneStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close(grace=1.0)

    async def connected(self) -> None:
        """Returns once the channel is ready, at once when it is; raises UNAVAILABLE when it
        is not within connect_wait_s."""
        state = self.channel.get_state(try_to_connect=True)
        if state == grpc.ChannelConnectivity.READY:
            return
        try:
            async with asyncio.timeout(self.connect_wait_s):
                while state != grpc.ChannelConnectivity.READY:
                    await self.channel.wait_for_state_change(state)
                    state = self.channel.get_state(try_to_connect=True)
        except TimeoutError:
            raise unavailable(f"no connection to {self.address}") from None

    def generate(self, request: pb.GenerateRequest) -> GenerateStream:
        """The server stream of one request; cancelling the call aborts it upstream."""
        return GenerateStream(self, request)

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        await self.connected()
        return await self.stub.Tokenize(request)

    async def detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        await self.connected()
        return await self.stub.Detokenize(request)

    async def stats(self) -> pb.StatsResponse:
        await self.connected()
        return await self.stub.Stats(pb.StatsRequest(), timeout=self.timeout_s)

    async def models(self) -> list[pb.ModelInfo]:
        """The served models. No deadline of ours: before any worker has registered the control
        plane holds the call for up to its --worker-wait-timeout, as it holds a Generate."""
        await self.connected()
        resp = await self.stub.ListModels(pb.ListModelsRequest())
        return list(resp.models)

    async def serving(self) -> bool:
        """True while the control plane reports SERVING and at least one worker is healthy."""
        try:
            await self.connected()
            health = await self.health_stub.Check(
                health_pb2.HealthCheckRequest(), timeout=self.timeout_s
            )
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                return False
            stats = await self.stats()
        except grpc.aio.AioRpcError:
            return False
        return any(w.healthy for w in stats.workers)
