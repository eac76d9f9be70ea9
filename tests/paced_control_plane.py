"""A scripted control plane (an in-process gRPC server) for gateway tests that need its timing
or its sizes under control rather than a model: a paced stream, and answers of a chosen size.

On the gateway's GenerateMany call, by prompt text:

* "paced": one token every `PACE_S`, until the gateway aborts it;
* "big:<bytes>": one final message whose text is that many "x" characters;
* anything else (token ids, chats): one final message, "b".
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc

PACE_S = 0.01
MODEL = "paced-model"


def final(request_id: str, text: str = "b") -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id, token_ids=[2], text=text, prompt_tokens=3, completion_tokens=1,
        finish_reason="length", last=True,
    )  # fmt: skip


@dataclass
class PacedControlPlane(pb_grpc.ControlPlaneServicer):
    seen: list[pb.GenerateRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def GenerateMany(
        self, request_iterator: Iterator[pb.GenerateManyRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateManyResponse]:
        answers: queue.SimpleQueue[pb.GenerateResponse] = queue.SimpleQueue()
        paced: dict[str, int] = {}  # request id -> tokens sent

        def read() -> None:
            try:
                for msg in request_iterator:
                    take(msg)
            except grpc.RpcError:
                pass  # the call ended

        def take(msg: pb.GenerateManyRequest) -> None:
            if msg.WhichOneof("kind") == "abort":
                with self.lock:
                    paced.pop(msg.abort, None)
                return
            req = msg.generate
            with self.lock:
                self.seen.append(req)
                if req.text == "paced":
                    paced[req.request_id] = 0
                    return
            if req.text.startswith("big:"):
                answers.put(final(req.request_id, "x" * int(req.text[4:])))
            else:
                answers.put(final(req.request_id))

        threading.Thread(target=read, daemon=True).start()
        while context.is_active():
            batch = pb.GenerateManyResponse()
            while not answers.empty():
                batch.responses.append(answers.get())
            with self.lock:
                for rid, sent in paced.items():
                    paced[rid] = sent + 1
                    batch.responses.add(
                        request_id=rid, token_ids=[1], text="a", prompt_tokens=3,
                        completion_tokens=sent + 1,
                    )  # fmt: skip
            if batch.responses:
                yield batch
            time.sleep(PACE_S)

    def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=MODEL, max_model_len=1 << 20)])

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse(workers=[pb.WorkerStats(healthy=True)])


class PacedServer:
    """The scripted control plane serving on a free local port until `stop`."""

    def __init__(self) -> None:
        self.control_plane = PacedControlPlane()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8),
            options=[("grpc.max_receive_message_length", 64 << 20)],
        )
        pb_grpc.add_ControlPlaneServicer_to_server(self.control_plane, self.server)
        hs = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, self.server)
        hs.set("", health_pb2.HealthCheckResponse.SERVING)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None)
