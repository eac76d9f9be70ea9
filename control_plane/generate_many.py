"""The requests of one GenerateMany call, their chunks sent in batches; and the line logged when a
request finishes, on either call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from control_plane.engine import OutputChunk, RequestStream, merge_chunks
from control_plane.grpc_errors import status_for
from control_plane.plane import ControlPlane
from control_plane.to_proto import chunk_to_proto
from pagedserve import grpc_security
from pagedserve.log import get_logger
from pagedserve.sampling_params import InvalidRequestError
from protos.v1 import control_plane_pb2 as pb

log = get_logger(__name__)

Sink = Callable[[OutputChunk | BaseException], None]
# Admits one request (the servicer's): (request, request id, sink) -> its stream.
StartRequest = Callable[[pb.GenerateRequest, str, Sink], Awaitable[RequestStream]]


def log_finished(req_id: str, chunk: OutputChunk) -> None:
    log.info(
        "request_finished",
        request_id=req_id,
        finish_reason=chunk.finish_reason,
        completion_tokens=chunk.num_output_tokens,
        time_to_first_token_s=chunk.time_to_first_token_s,
    )


class ManyCalls:
    """The requests of one GenerateMany call. The engine's chunks for all of them land in one
    list (each request's `sink`); the call's writer takes everything there at once, merges it
    per completion as Generate does, and sends it as one message."""

    def __init__(
        self,
        start: StartRequest,
        cp: ControlPlane,
        owners: grpc_security.RequestOwners,
        context: grpc.aio.ServicerContext,
    ):
        self.start = start
        self.cp = cp
        self.owners = owners
        self.context = context
        self.live: dict[str, RequestStream | None] = {}  # None: still being admitted
        self.owned: dict[str, Callable[[], None]] = {}  # releases each request's owner entry
        self.pending: list[tuple[str, OutputChunk | BaseException]] = []
        self.wake = asyncio.Event()
        self.starting: set[asyncio.Task[None]] = set()

    def _sink(self, req_id: str) -> Callable[[OutputChunk | BaseException], None]:
        def put(item: OutputChunk | BaseException) -> None:
            self.pending.append((req_id, item))
            self.wake.set()

        return put

    async def read(self, requests: AsyncIterator[pb.GenerateManyRequest]) -> None:
        async for msg in requests:
            kind = msg.WhichOneof("kind")
            if kind == "generate":
                req_id = msg.generate.request_id
                if not req_id or req_id in self.live:
                    # The id names the request in both directions: a second one would be
                    # indistinguishable, so both end here.
                    self._abort(req_id)
                    why = f"request_id {req_id!r} is empty or already running on this call"
                    self._fail(req_id, InvalidRequestError(f"GenerateMany: {why}"))
                    continue
                self.live[req_id] = None
                task = asyncio.create_task(self._start(req_id, msg.generate))
                self.starting.add(task)
                task.add_done_callback(self.starting.discard)
            elif kind == "abort":
                self._abort(msg.abort)
        self.wake.set()  # the client sends nothing more: the call ends when its requests do

    async def _start(self, req_id: str, request: pb.GenerateRequest) -> None:
        try:
            stream = await self.start(request, req_id, self._sink(req_id))
        except Exception as exc:
            code, message = status_for(exc)
            log.info("request_rejected", request_id=req_id, code=code.name, reason=message)
            self._fail(req_id, exc)
            return
        if self.live.get(req_id, stream) is not None:  # aborted while it was being admitted
            self.cp.abort(req_id)
            return
        self.live[req_id] = stream
        self.owned[req_id] = self.owners.claim(req_id, self.context)

    def _fail(self, req_id: str, exc: BaseException) -> None:
        self.pending.append((req_id, exc))
        self.wake.set()

    def _end(self, req_id: str) -> RequestStream | None:
        release = self.owned.pop(req_id, None)
        if release is not None:
            release()
        return self.live.pop(req_id, None)

    def _abort(self, req_id: str) -> None:
        stream = self._end(req_id)
        if stream is not None and not stream.finished:
            self.cp.abort(req_id)
            log.info("request_cancelled", request_id=req_id)

    async def next_batch(self, reader: asyncio.Task[None]) -> pb.GenerateManyResponse | None:
        """What the requests produced since the last batch; None once the client has closed
        its side and no request is left."""
        while True:
            while not self.pending:
                if reader.done() and not self.live:
                    reader.result()  # a broken request stream ends the call with its error
                    return None
                self.wake.clear()
                await self.wake.wait()
            batch = self._take()
            if batch.responses or batch.errors:
                return batch

    def _take(self) -> pb.GenerateManyResponse:
        items, self.pending = self.pending, []
        per_request: dict[str, list[OutputChunk | BaseException]] = {}
        for req_id, item in items:
            per_request.setdefault(req_id, []).append(item)
        batch = pb.GenerateManyResponse()
        tok = self.cp.tokenizer
        for req_id, chunks in per_request.items():
            for item in merge_chunks(chunks):
                if isinstance(item, BaseException):
                    code, message = status_for(item)
                    batch.errors.add(request_id=req_id, code=code.value[0], message=message)
                    self._end(req_id)
                    break
                if req_id not in self.live:
                    continue  # aborted by the client: nobody wants the rest
                batch.responses.append(chunk_to_proto(req_id, item, tok))
                if item.last:
                    log_finished(req_id, item)
                    self._end(req_id)
                    break
        return batch

    def close(self) -> None:
        """The call ended: whatever still runs on it is aborted, its blocks freed."""
        for task in self.starting:
            task.cancel()
        for req_id in list(self.live):
            self._abort(req_id)
