"""The gateway's only link to the control plane: one grpc.aio channel and its calls."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.grpc_security import INSECURE, GrpcSecurity, aio_channel
from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 128 << 20),  # a final-only completion is one message
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.keepalive_time_ms", 30_000),
]


class Upstream:
    """ControlPlane and grpc.health.v1 stubs over one channel. Create it inside the event
    loop that will use it (grpc.aio binds the channel to the running loop)."""

    def __init__(
        self, address: str, timeout_s: float, *, security: GrpcSecurity = INSECURE
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = aio_channel(address, security, _CHANNEL_OPTIONS)
        self.stub = pb_grpc.ControlPlaneStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close(grace=1.0)

    def generate(self, request: pb.GenerateRequest) -> grpc.aio.UnaryStreamCall:
        """The server stream of one request; cancelling the call aborts it upstream."""
        return self.stub.Generate(request)

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        return await self.stub.Tokenize(request)

    async def detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        return await self.stub.Detokenize(request)

    async def stats(self) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest(), timeout=self.timeout_s)

    async def models(self) -> list[pb.ModelInfo]:
        resp = await self.stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout_s)
        return list(resp.models)

    async def serving(self) -> bool:
        """True while the control plane reports SERVING and at least one worker is healthy."""
        try:
            health = await self.health_stub.Check(
                health_pb2.HealthCheckRequest(), timeout=self.timeout_s
            )
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                return False
            stats = await self.stats()
        except grpc.aio.AioRpcError:
            return False
        return any(w.healthy for w in stats.workers)
