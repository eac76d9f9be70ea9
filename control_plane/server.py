"""The control-plane process: the ControlPlane service (`control_plane.servicer`), gRPC health
and reflection on one server, serving until cancelled."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control_plane.config import ControlPlaneConfig
from control_plane.plane import ControlPlane
from control_plane.servicer import ControlPlaneServicer
from pagedserve import grpc_security
from pagedserve.heap import freeze_heap
from pagedserve.log import get_logger
from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc

log = get_logger(__name__)

# How often the health service is brought in line with the workers' state.
HEALTH_POLL_S = 0.2
# The health service name that only says the process runs (Kubernetes' liveness probe).
LIVENESS_SERVICE = "liveness"


async def serve(config: ControlPlaneConfig) -> None:
    """Connects to the workers and serves until cancelled (SIGINT/SIGTERM)."""
    cp = ControlPlane(config)
    server = grpc_security.aio_server(
        config.grpc_security,
        options=[
            ("grpc.max_receive_message_length", 16 << 20),
            # A final-only message carries a whole completion (~300 B a token with logprobs).
            ("grpc.max_send_message_length", 128 << 20),
            # Accept the gateway's keepalive pings (every 30 s) on a quiet connection: by
            # default a server allows one per 5 minutes without data and answers the third
            # with GOAWAY "too_many_pings", failing the gateway's next request.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    pb_grpc.add_ControlPlaneServicer_to_server(ControlPlaneServicer(cp), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_name = pb.DESCRIPTOR.services_by_name["ControlPlane"].full_name
    reflection.enable_server_reflection(
        (
            service_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    grpc_security.add_port(server, f"{config.host}:{config.port}", config.grpc_security)
    await server.start()
    # "" and the service name: SERVING while a worker answers (readiness, and what the
    # gateway's /health reports); "liveness": SERVING while this process runs.
    await health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    log.info("control_plane_listening", address=f"{config.host}:{config.port}")
    follow = asyncio.create_task(_follow_health(cp, health_servicer, ("", service_name)))
    try:
        await cp.connect()
        log.info(
            "control_plane_ready",
            model=cp.model_name,
            workers=[lp.client.address for lp in cp.loops],
            frozen_objects=freeze_heap(),
        )
        await server.wait_for_termination()
    finally:
        follow.cancel()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=5)
        await cp.close()


async def _follow_health(
    cp: ControlPlane, servicer: health.aio.HealthServicer, names: tuple[str, ...]
) -> None:
    """Keeps the health service's status equal to `cp.serving`, logging each change."""
    serving: bool | None = None
    while True:
        now = cp.serving
        if now != serving:
            serving = now
            status = health_pb2.HealthCheckResponse
            for name in names:
                await servicer.set(name, status.SERVING if now else status.NOT_SERVING)
            if cp.info is not None:
                log.info("control_plane_serving" if now else "control_plane_not_serving")
        await asyncio.sleep(HEALTH_POLL_S)
