"""The ControlPlane gRPC servicer over `control_plane.plane`.

Servicers stay thin: protobuf in -> domain call -> protobuf out. Domain errors map to gRPC
status codes in `control_plane.grpc_errors`, the one place that does so.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from control_plane.chat import parse_template_kwargs, parse_tools, template_message
from control_plane.engine import OutputChunk, RequestStream, merge_chunks
from control_plane.generate_many import ManyCalls, log_finished
from control_plane.grpc_errors import status_for
from control_plane.plane import AdmissionError, ControlPlane
from control_plane.request import Request
from control_plane.to_proto import chunk_to_proto, stats_to_proto
from pagedserve import grpc_security, wire
from pagedserve.log import get_logger
from pagedserve.sampling_params import InvalidRequestError
from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc

log = get_logger(__name__)


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
            code, message = status_for(exc)
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
                        code, message = status_for(item)
                        await context.abort(code, message)
                        return
                    yield chunk_to_proto(req_id, item, cp.tokenizer)
                    if item.last:
                        log_finished(req_id, item)
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
        calls = ManyCalls(self._start, self.cp, self.owners, context)
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
            code, message = status_for(exc)
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
            code, message = status_for(exc)
            await context.abort(code, message)
        return pb.DetokenizeResponse(text=text)


def _check_model(cp: ControlPlane, model: str) -> None:
    if model and model != cp.model_name:
        raise AdmissionError(grpc.StatusCode.NOT_FOUND, f"model {model!r} is not served here")


def _flag(msg: Any, name: str) -> bool:
    """An optional bool of the request: true unless set false (the HTTP API's defaults)."""
    return bool(getattr(msg, name)) if msg.HasField(name) else True
