"""/metrics: the control plane's Stats, read at each scrape, beside the gateway's own timings
(`gateway.metrics`), labelled with the model name once a worker has registered."""

from __future__ import annotations

import grpc

from gateway.errors import APIError
from gateway.serving import Gateway
from protos.v1 import control_plane_pb2 as pb


async def metrics_text(gw: Gateway) -> bytes:
    """The metrics in Prometheus's text format; the control plane's part is left out when its
    Stats call fails."""
    try:
        snapshot: pb.StatsResponse | None = await gw.upstream.stats()
    except grpc.aio.AioRpcError:
        snapshot = None
    name = ""
    # Before a worker has registered the model is unknown, and asking would wait for one.
    if gw.config.served_model_name is not None or (snapshot is not None and snapshot.workers):
        try:
            name, _ = await gw.model_names(None)
        except APIError:
            pass
    return gw.metrics.render(snapshot, name)
