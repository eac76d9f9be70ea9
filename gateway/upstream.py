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
import contextvars
from collections import deque
from collections.abc import AsyncIterator, Callable

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


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    empty = grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, empty, empty, details)


def unavailable(details: str) -> grpc.aio.AioRpcError:
    """The error a call to an unreachable control plane fails with."""
    return rpc_error(grpc.StatusCode.UNAVAILABLE, details)


# An HTTP request's messages wait one per engine step while its client keeps up; past this many
# waiting (a client reading slower than the engine steps), each new one is merged into the last
# one of its completion still waiting.
MERGE_AFTER = 64


class Stalled(Exception):
    """The client took nothing for the stall timeout while messages waited for it."""


class Inbox:
    """Where the messages of one HTTP request's upstream calls wait for its response to take
    them, each under its call's slot. The response wakes once per engine step and takes what
    all its calls delivered in it (`take`), however many completions they carry.

    A client that takes nothing for `stall_timeout_s` while messages wait is stalled: the next
    message to come finds it so, `on_stall` runs (the owner aborts the calls upstream, which
    frees their KV blocks) and, after what is waiting, `take` yields a `Stalled`. Messages for
    every completion come every step while its calls run, so the stall is seen within a step
    of the timeout."""

    def __init__(
        self, stall_timeout_s: float, on_message: Callable[[int, pb.GenerateResponse], None]
    ) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.on_message = on_message  # called as each message comes (the gateway's timers)
        self.on_stall: Callable[[], None] = lambda: None
        self._loop = asyncio.get_running_loop()
        self._pending: deque[tuple[int, pb.GenerateResponse | grpc.aio.AioRpcError | Stalled]] = (
            deque()
        )
        self._newest: dict[tuple[int, int], pb.GenerateResponse] = {}  # (slot, index) -> waiting
        self._waiting_since = 0.0  # when the oldest message now waiting came
        self._waiter: asyncio.Future[None] | None = None
        self.stalled = False

    def put(self, slot: int, item: pb.GenerateResponse | grpc.aio.AioRpcError) -> None:
        if self.stalled:  # its calls are aborted: nothing more goes out but the stall
            return
        pending = self._pending
        if isinstance(item, pb.GenerateResponse):
            self.on_message(slot, item)
            key = (slot, item.index)
            if len(pending) >= MERGE_AFTER:
                newest = self._newest.get(key)
                if newest is not None:
                    _append(newest, item)
                    self._check_stall()
                    return
            self._newest[key] = item
        if not pending:
            self._waiting_since = self._loop.time()
        pending.append((slot, item))
        self._check_stall()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _check_stall(self) -> None:
        if self.stalled or self._loop.time() - self._waiting_since < self.stall_timeout_s:
            return
        self.stalled = True
        self.on_stall()
        self._pending.append((-1, Stalled()))

    async def take(self) -> list[tuple[int, pb.GenerateResponse | grpc.aio.AioRpcError | Stalled]]:
        """What waits, in the order it came; waits for something first."""
        while not self._pending:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._pending)
        self._pending.clear()
        self._newest.clear()
        return items


class GenerateStream:
    """One request on the upstream's GenerateMany call: `open` sends it; its messages, or the
    status a refused or broken call fails with, go to `inbox` under `slot`, the call's last
    message (`last`) or a status ending it; `cancel` aborts it upstream."""

    def __init__(
        self, upstream: Upstream, request: pb.GenerateRequest, inbox: Inbox, slot: int
    ) -> None:
        self._upstream = upstream
        self._request = request
        self._inbox = inbox
        self._slot = slot
        self._call: _ManyCall | None = None
        self._cancelled = False
        self._ended = False

    async def open(self) -> None:
        """Sends the request; raises the status of a control plane that stays unreachable, or
        ALREADY_EXISTS (409) for a request id in use."""
        await self._upstream.connected()
        if self._cancelled:
            return
        call = self._upstream.many_call()
        call.start(self._request, self)
        self._call = call

    def deliver(self, item: pb.GenerateResponse | grpc.aio.AioRpcError) -> None:
        if isinstance(item, grpc.aio.AioRpcError) or item.last:
            self._ended = True
        self._inbox.put(self._slot, item)

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None and not self._ended:
            self._ended = True
            self._call.abort(self._request.request_id)


def _append(msg: pb.GenerateResponse, later: pb.GenerateResponse) -> None:
    """`later` folded into `msg`, an earlier message of the same completion, in place."""
    msg.token_ids.extend(later.token_ids)
    msg.text += later.text
    msg.logprobs.extend(later.logprobs)
    msg.completion_tokens = later.completion_tokens
    msg.finish_reason = later.finish_reason
    msg.stop_reason = later.stop_reason
    for name in ("stop_token_id", "sequence_score"):
        if later.HasField(name):
            setattr(msg, name, getattr(later, name))
    msg.time_to_first_token_s = later.time_to_first_token_s
    msg.last = later.last


class _ManyCall:
    """The gateway's GenerateMany call: every request travels on it, and every engine step's
    messages for all of them come back as one. A broken call fails the requests it carries
    with its status (UNAVAILABLE for a control plane that went away); the next request opens
    a new one."""

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream
        self._outbox: asyncio.Queue[pb.GenerateManyRequest] = asyncio.Queue()
        self._streams: dict[str, GenerateStream] = {}
        self._call = upstream.stub.GenerateMany(self._outgoing())
        # Carries every request's messages: none of the log context of the one that opened it.
        self._reader = asyncio.create_task(self._read(), context=contextvars.Context())
        self.broken = False

    async def _outgoing(self) -> AsyncIterator[pb.GenerateManyRequest]:
        while True:
            yield await self._outbox.get()

    def start(self, request: pb.GenerateRequest, stream: GenerateStream) -> None:
        req_id = request.request_id
        if req_id in self._streams:
            why = f"request id {req_id!r} is already in use by a request in progress"
            raise rpc_error(grpc.StatusCode.ALREADY_EXISTS, why)
        self._streams[req_id] = stream
        self._outbox.put_nowait(pb.GenerateManyRequest(generate=request))

    def abort(self, req_id: str) -> None:
        if self._streams.pop(req_id, None) is not None and not self.broken:
            self._outbox.put_nowait(pb.GenerateManyRequest(abort=req_id))

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError
        try:
            async for batch in self._call:
                streams = self._streams
                for msg in batch.responses:
                    stream = streams.get(msg.request_id)
                    if stream is not None:
                        if msg.last:
                            del streams[msg.request_id]
                        stream.deliver(msg)
                for err in batch.errors:
                    stream = streams.pop(err.request_id, None)
                    if stream is not None:
                        code = _STATUS_CODES.get(err.code, grpc.StatusCode.UNKNOWN)
                        stream.deliver(rpc_error(code, err.message))
            error = unavailable("the control plane ended the call")
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = unavailable("the gateway is stopping")
        self.broken = True
        self._upstream.forget(self)
        for stream in self._streams.values():
            stream.deliver(error)
        self._streams.clear()

    def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


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
        self._many: _ManyCall | None = None

    async def close(self) -> None:
        if self._many is not None:
            self._many.close()
        await self.channel.close(grace=1.0)

    def many_call(self) -> _ManyCall:
        """The GenerateMany call requests go on, opened now if there is none."""
        if self._many is None:
            self._many = _ManyCall(self)
        return self._many

    def forget(self, call: _ManyCall) -> None:
        if self._many is call:
            self._many = None

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

    def generate(self, request: pb.GenerateRequest, inbox: Inbox, slot: int) -> GenerateStream:
        """One request (its request_id set, unique among those running), its messages for
        `inbox` under `slot`; cancelling the stream aborts it upstream."""
        return GenerateStream(self, request, inbox, slot)

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
