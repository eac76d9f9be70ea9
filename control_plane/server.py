"""The control-plane process: the ControlPlane gRPC service over `control_plane.plane`.

Servicers stay thin: protobuf in -> domain call -> protobuf out. Domain errors map to gRPC
status codes in `_status_for`, the one place that does so.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control_plane.chat import parse_template_kwargs, parse_tools, template_message
from control_plane.config import ControlPlaneConfig
from control_plane.engine import OutputChunk, RequestStream, merge_chunks
from control_plane.plane import AdmissionError, ControlPlane
from control_plane.request import Request
from control_plane.tokenizer import LoadedTokenizer
from control_plane.worker_client import WorkerError, WorkerRefusal
from pagedserve import grpc_security, wire
from pagedserve.heap import freeze_heap
from pagedserve.log import get_logger
from pagedserve.plan import SampledToken
from pagedserve.sampling_params import InvalidRequestError
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc

log = get_logger(__name__)

# How often the health service is brought in line with the workers' state.
HEALTH_POLL_S = 0.2
# The health service name that only says the process runs (Kubernetes' liveness probe).
LIVENESS_SERVICE = "liveness"


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, AdmissionError):
        return exc.code, str(exc)
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, WorkerError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, WorkerRefusal):
        return grpc.StatusCode.INTERNAL, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


class ControlPlaneServicer(pb_grpc.ControlPlaneServicer):
    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.owners = grpc_security.RequestOwners()

    async def _start(
        self,
        request: pb.GenerateRequest,
        req_id: str,
        sink: Callable[[OutputChunk | BaseException], None] | None = None,
    ) -> RequestStream:
        """Admits one request and puts it on a worker; raises what it is refused for."""
        cp = self.cp
        await cp.wait_ready()
        _check_model(cp, request.model)
        prompt_ids = await self._prompt_ids(request)
        default_max_tokens = None
        if request.WhichOneof("prompt") == "chat":
            s = request.sampling
            default_max_tokens = cp.default_max_tokens(
                len(prompt_ids),
                s.n or 1,
                s.logprobs if s.HasField("logprobs") else None,
                s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
            )
        sampling = wire.sampling_from_proto(request.sampling, default_max_tokens)
        salt = request.cache_salt or None
        loop = await cp.admit(req_id, prompt_ids, sampling, salt, request.batch_id)
        stream = loop.add_request(
            Request(req_id, prompt_ids, sampling, time.monotonic(), cache_salt=salt),
            final_only=request.output_kind == pb.OUTPUT_KIND_FINAL_ONLY,
            sink=sink,
            batch_id=request.batch_id,
        )
        log.info(
            "request_admitted",
            request_id=req_id,
            prompt_tokens=len(prompt_ids),
            max_tokens=sampling.max_tokens,
            worker=loop.client.address,
        )
        return stream

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        req_id = request.request_id or uuid.uuid4().hex
        cp = self.cp
        try:
            stream = await self._start(request, req_id)
        except Exception as exc:  # every admission failure becomes a clear status
            code, message = _status_for(exc)
            log.info("request_rejected", request_id=req_id, code=code.name, reason=message)
            await context.abort(code, message)
            return
        self.owners.record(req_id, context)
        try:
            while True:
                # Everything queued since the last message goes out merged per completion: a
                # client that reads slower than the engine steps gets fewer, larger messages.
                items = [await stream.queue.get()]
                while not stream.queue.empty():
                    items.append(stream.queue.get_nowait())
                for item in merge_chunks(items):
                    if isinstance(item, BaseException):
                        code, message = _status_for(item)
                        await context.abort(code, message)
                        return
                    yield _chunk_to_proto(req_id, item, cp.tokenizer)
                    if item.last:
                        _log_finished(req_id, item)
                        return
        finally:
            if not stream.finished:
                # The client went away (or the server is stopping): free the blocks now.
                cp.abort(req_id)
                log.info("request_cancelled", request_id=req_id)

    async def GenerateMany(
        self,
        request_iterator: AsyncIterator[pb.GenerateManyRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        calls = _ManyCalls(self, context)
        reader = asyncio.create_task(calls.read(request_iterator))
        try:
            while True:
                batch = await calls.next_batch(reader)
                if batch is None:
                    return
                yield batch
        finally:
            reader.cancel()
            calls.close()

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "token_ids":
            return list(request.token_ids.ids)
        tok = self.cp.tokenizer
        assert tok is not None
        if which == "chat":
            messages = [template_message(m) for m in request.chat.messages]
            # Special tokens only where the template writes them (any BOS included): special-
            # token text typed in a message is tokenized as the text it is.
            chat_req = request.chat
            tools = parse_tools(chat_req.tools_json) if chat_req.tools_json else None
            kwargs_json = chat_req.chat_template_kwargs_json
            kwargs = parse_template_kwargs(kwargs_json) if kwargs_json else None
            agp = _flag(chat_req, "add_generation_prompt")
            chat = tok.chat_prompt(messages, agp, tools, kwargs)
            return await self.cp.tokenize(chat.text, False, chat.literal)
        if which != "text":
            raise InvalidRequestError("a prompt is required: set text, token_ids or chat")
        if not request.text:
            raise InvalidRequestError("the prompt is empty")
        return await self.cp.tokenize(request.text, _flag(request, "add_special_tokens"))

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        # Only the caller that started a request may abort it; anyone else is told it was not
        # found, which does not even reveal that the id is in use.
        if not self.owners.owns(request.request_id, context):
            return pb.AbortResponse(found=False)
        return pb.AbortResponse(found=self.cp.abort(request.request_id))

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        try:
            await self.cp.wait_ready()
        except AdmissionError as exc:
            await context.abort(exc.code, str(exc))
        info = self.cp.info
        assert info is not None
        model = pb.ModelInfo(
            id=self.cp.model_name,
            max_model_len=info.max_model_len,
            architecture=info.architecture,
            vocab_size=info.vocab_size,
        )
        return pb.ListModelsResponse(models=[model])

    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        return stats_to_proto(self.cp)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        cp = self.cp
        try:
            await cp.wait_ready()
            _check_model(cp, request.model)
            which = request.WhichOneof("prompt")
            if which is None:
                raise InvalidRequestError("a prompt is required: set text or chat")
            # Through Generate's own path, so the ids are exactly those Generate would see.
            as_generate = pb.GenerateRequest()
            if which == "chat":
                as_generate.chat.CopyFrom(request.chat)
            else:
                as_generate.text = request.text
                if request.HasField("add_special_tokens"):
                    as_generate.add_special_tokens = request.add_special_tokens
            ids = await self._prompt_ids(as_generate)
        except Exception as exc:
            code, message = _status_for(exc)
            await context.abort(code, message)
        assert cp.info is not None and cp.tokenizer is not None
        resp = pb.TokenizeResponse(token_ids=ids, max_model_len=cp.info.max_model_len)
        if request.return_token_strs:
            vocab = cp.tokenizer.tokenizer
            resp.token_strs.extend(vocab.id_to_token(t) or "" for t in ids)
        return resp

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        cp = self.cp
        try:
            await cp.wait_ready()
            _check_model(cp, request.model)
            assert cp.info is not None and cp.tokenizer is not None
            ids = list(request.token_ids)
            if any(t >= cp.info.vocab_size for t in ids):
                raise InvalidRequestError(f"token ids must be < vocab size {cp.info.vocab_size}")
            text = await asyncio.to_thread(
                cp.tokenizer.tokenizer.decode, ids, skip_special_tokens=False
            )
        except Exception as exc:
            code, message = _status_for(exc)
            await context.abort(code, message)
        return pb.DetokenizeResponse(text=text)


def _log_finished(req_id: str, chunk: OutputChunk) -> None:
    log.info(
        "request_finished",
        request_id=req_id,
        finish_reason=chunk.finish_reason,
        completion_tokens=chunk.num_output_tokens,
        time_to_first_token_s=chunk.time_to_first_token_s,
    )


class _ManyCalls:
    """The requests of one GenerateMany call. The engine's chunks for all of them land in one
    list (each request's `sink`); the call's writer takes everything there at once, merges it
    per completion as Generate does, and sends it as one message."""

    def __init__(self, servicer: ControlPlaneServicer, context: grpc.aio.ServicerContext):
        self.servicer = servicer
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
            stream = await self.servicer._start(request, req_id, self._sink(req_id))
        except Exception as exc:
            code, message = _status_for(exc)
            log.info("request_rejected", request_id=req_id, code=code.name, reason=message)
            self._fail(req_id, exc)
            return
        if self.live.get(req_id, stream) is not None:  # aborted while it was being admitted
            self.servicer.cp.abort(req_id)
            return
        self.live[req_id] = stream
        self.owned[req_id] = self.servicer.owners.claim(req_id, self.context)

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
            self.servicer.cp.abort(req_id)
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
        tok = self.servicer.cp.tokenizer
        for req_id, chunks in per_request.items():
            for item in merge_chunks(chunks):
                if isinstance(item, BaseException):
                    code, message = _status_for(item)
                    batch.errors.add(request_id=req_id, code=code.value[0], message=message)
                    self._end(req_id)
                    break
                if req_id not in self.live:
                    continue  # aborted by the client: nobody wants the rest
                batch.responses.append(_chunk_to_proto(req_id, item, tok))
                if item.last:
                    _log_finished(req_id, item)
                    self._end(req_id)
                    break
        return batch

    def close(self) -> None:
        """The call ended: whatever still runs on it is aborted, its blocks freed."""
        for task in self.starting:
            task.cancel()
        for req_id in list(self.live):
            self._abort(req_id)


def stats_to_proto(cp: ControlPlane) -> pb.StatsResponse:
    router = cp.router
    workers = []
    for loop in cp.loops:
        s = loop.scheduler.stats()
        bm = loop.scheduler.block_manager
        workers.append(
            pb.WorkerStats(
                address=loop.client.address,
                num_running=s.num_running,
                num_waiting=s.num_waiting,
                num_swapped=s.num_swapped,
                num_gpu_blocks=bm.num_gpu_blocks,
                num_free_gpu_blocks=bm.num_free_gpu_blocks,
                num_cpu_blocks=bm.num_cpu_blocks,
                num_free_cpu_blocks=bm.num_free_cpu_blocks,
                kv_cache_usage=s.gpu_kv_usage,
                num_preemptions=s.num_preemptions,
                num_recompute_preemptions=s.num_preemptions_recompute,
                num_swap_preemptions=s.num_preemptions_swap,
                num_chunked_prefill_steps=s.num_chunked_prefill_steps,
                num_steps=loop.counters.num_steps,
                num_prompt_tokens_computed=loop.counters.num_prompt_tokens_computed,
                num_generated_tokens=loop.counters.num_generated_tokens,
                healthy=loop.healthy,
                epoch=loop.info.epoch,
                num_blocks_swapped_out=s.num_swapped_out_blocks,
                num_blocks_swapped_in=s.num_swapped_in_blocks,
                prefix_cache_queries=s.prefix_cache.num_queries,
                prefix_cache_hits=s.prefix_cache.num_hits,
                prefix_cache_query_tokens=s.prefix_cache.num_query_tokens,
                prefix_cache_hit_tokens=s.prefix_cache.num_hit_tokens,
                num_cached_blocks=s.prefix_cache.num_cached_blocks,
                num_gpu_block_refs=s.num_gpu_block_refs,
                num_forks=s.num_forks,
                num_copied_blocks=s.num_copied_blocks,
                peak_used_gpu_blocks=s.peak_used_gpu_blocks,
                dtype=loop.info.dtype,
                kv_cache_dtype=loop.info.kv_cache_dtype,
            )
        )
    total_blocks = sum(w.num_gpu_blocks for w in workers) or 1
    used = sum(w.num_gpu_blocks - w.num_free_gpu_blocks for w in workers)
    return pb.StatsResponse(
        num_running=sum(w.num_running for w in workers),
        num_waiting=sum(w.num_waiting for w in workers),
        num_swapped=sum(w.num_swapped for w in workers),
        kv_cache_usage=used / total_blocks,
        num_preemptions=sum(w.num_preemptions for w in workers),
        num_requests_finished=sum(loop.counters.num_requests_finished for loop in cp.loops),
        num_requests_aborted=sum(loop.counters.num_requests_aborted for loop in cp.loops),
        num_chunked_prefill_steps=sum(w.num_chunked_prefill_steps for w in workers),
        workers=workers,
        prefix_cache_queries=sum(w.prefix_cache_queries for w in workers),
        prefix_cache_hits=sum(w.prefix_cache_hits for w in workers),
        prefix_cache_query_tokens=sum(w.prefix_cache_query_tokens for w in workers),
        prefix_cache_hit_tokens=sum(w.prefix_cache_hit_tokens for w in workers),
        prefix_index_available=router is not None and router.available,
        num_routed=router.counters.num_routed if router else 0,
        num_routed_with_prefix_hit=router.counters.num_routed_with_prefix_hit if router else 0,
    )


def _chunk_to_proto(
    req_id: str, chunk: OutputChunk, tok: LoadedTokenizer | None
) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=req_id,
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=chunk.finish_reason or "",
        prompt_tokens=chunk.num_prompt_tokens,
        completion_tokens=chunk.num_output_tokens,
        stop_reason="" if chunk.stop_reason is None else str(chunk.stop_reason),
        index=chunk.index,
        last=chunk.last,
    )
    if isinstance(chunk.stop_reason, int):
        msg.stop_token_id = chunk.stop_reason
    if chunk.time_to_first_token_s is not None:
        msg.time_to_first_token_s = chunk.time_to_first_token_s
    if chunk.sequence_score is not None:
        msg.sequence_score = chunk.sequence_score
    msg.logprobs.extend(_logprobs(t, tok) for t in chunk.logprobs if t.logprob is not None)
    if chunk.prompt_logprobs:
        msg.prompt_logprobs.extend(_logprobs(t, tok, True) for t in chunk.prompt_logprobs)
    return msg


def _logprobs(
    sampled: SampledToken, tok: LoadedTokenizer | None, with_id: bool = False
) -> common_pb2.TokenLogprobs:
    lp = wire.logprobs_to_proto(sampled, with_id)
    if tok is not None:
        lp.token = tok.token_text(sampled.token_id)
        lp.top_tokens.extend(tok.token_text(t) for t in sampled.top_token_ids)
    return lp


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


def _check_model(cp: ControlPlane, model: str) -> None:
    if model and model != cp.model_name:
        raise AdmissionError(grpc.StatusCode.NOT_FOUND, f"model {model!r} is not served here")


def _flag(msg: Any, name: str) -> bool:
    """An optional bool of the request: true unless set false (the HTTP API's defaults)."""
    return bool(getattr(msg, name)) if msg.HasField(name) else True
