"""A generation request's upstream calls, its budget, and the merged stream of their answers.

One Generate call per prompt (`expand_choices`); `n > 1` is forked by the control plane,
whose messages carry the completion's index. A batch of prompts is one call per prompt.
Choice index = prompt index * n + i, as OpenAI numbers them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
import structlog

from gateway.errors import APIError, bad_request, from_grpc
from gateway.metrics import GatewayMetrics
from gateway.upstream import Inbox, Stalled, Upstream
from pagedserve.log import get_logger
from protos.v1 import control_plane_pb2 as pb

log = get_logger(__name__)

# A client that takes nothing for this long while messages wait has its request aborted.
STREAM_STALL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Choice:
    """One Generate call, producing choices first_index .. first_index + n - 1."""

    first_index: int
    n: int
    request: pb.GenerateRequest

    @property
    def indices(self) -> range:
        return range(self.first_index, self.first_index + self.n)


@dataclass(frozen=True)
class ChoiceEvent:
    index: int
    message: pb.GenerateResponse


def expand_choices(
    req: pb.GenerateRequest, n: int, first_index: int, request_id: str, single: bool
) -> list[Choice]:
    """The Generate call for one prompt's n choices: `req`, a request of its own (a prompt
    can hold a million token ids: it is not copied), with its ids set. The request id is
    `request_id` for a lone prompt, `request_id-<first choice index>` in a batch, so every
    upstream request is unique and traceable; a batch's requests carry its id as `batch_id`
    (they count once against the waiting queue's limit). With a seed, the control plane gives
    each of the n its own seed stream."""
    req.request_id = request_id if single else f"{request_id}-{first_index}"
    if not single:
        req.batch_id = request_id
    if n > 1:
        req.sampling.n = n
    return [Choice(first_index, n, req)]


@dataclass(frozen=True)
class Budget:
    """What one HTTP request may ask for, all its prompts together."""

    max_request_tokens: int  # prompts x n x max_tokens (--max-request-tokens)
    max_logprob_entries: int  # logprob entries those tokens and echoed prompts carry

    def check(
        self,
        num_prompts: int,
        n: int,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_entries: int = 0,
    ) -> None:
        """400 naming the limit and its flag when the request asks for more. max_tokens None
        (a chat request without one) leaves the generated part to the control plane, whose
        default fits its own budget; prompt_entries are the prompt logprobs the choices
        carry (each choice its prompt's)."""
        tokens = num_prompts * n * (max_tokens or 0)
        if tokens > self.max_request_tokens:
            raise bad_request(
                f"this request asks for up to {tokens} generated tokens (prompts ({num_prompts}) "
                f"x n ({n}) x max_tokens ({max_tokens})), more than one request may "
                f"({self.max_request_tokens}; the gateway's --max-request-tokens raises it)",
                "max_tokens",
            )
        entries = prompt_entries + (0 if logprobs is None else tokens * (1 + logprobs))
        if entries > self.max_logprob_entries:
            raise bad_request(
                f"this request asks for up to {entries} logprob entries (generated tokens "
                f"({tokens}) x (1 + logprobs ({logprobs})), + prompt tokens x (1 + "
                f"prompt_logprobs) per choice: {prompt_entries}), more than one request may "
                f"({self.max_logprob_entries}; the gateway's --max-logprob-entries raises it)",
                "logprobs",
            )


async def stream_choices(
    upstream: Upstream,
    choices: list[Choice],
    metrics: GatewayMetrics,
    model_name: str,
    retry_after_s: int,
    stall_timeout_s: float = STREAM_STALL_TIMEOUT_S,
) -> AsyncGenerator[list[ChoiceEvent], None]:
    """Runs every choice's Generate call at once and yields their messages as they arrive:
    what came in one engine step as one list.

    The first upstream error is raised (as an APIError) after what came before it, and the other
    calls are cancelled; closing or cancelling the iterator cancels every call still running,
    which makes the control plane free their blocks at once.

    Backpressure: messages wait in the request's `Inbox` for a client that reads slower than the
    engine writes, merged past MERGE_AFTER into as few as the client takes. A client that takes
    nothing for stall_timeout_s has its calls cancelled (their KV blocks freed), logged as
    `stream_stalled`; what was waiting goes out should it read again, then an error event.
    """
    timers = [
        metrics.timer(model_name, c.request.output_kind == pb.OUTPUT_KIND_FINAL_ONLY)
        for c in choices
    ]
    inbox = Inbox(stall_timeout_s, lambda slot, msg: timers[slot].on_message(msg))
    streams = [upstream.generate(c.request, inbox, slot) for slot, c in enumerate(choices)]
    # The stall is noticed on the task that reads every request's messages: named here.
    request_id = structlog.contextvars.get_contextvars().get("request_id")

    def stall() -> None:
        log.warning(
            "stream_stalled",
            request_id=request_id,
            stall_timeout_s=stall_timeout_s,
            upstream_ids=[c.request.request_id for c in choices],
        )
        for s in streams:
            s.cancel()

    inbox.on_stall = stall
    try:
        for s in streams:
            await s.open()
        remaining = len(streams)
        while remaining:
            batch: list[ChoiceEvent] = []
            failure: APIError | None = None
            for slot, item in await inbox.take():
                if isinstance(item, pb.GenerateResponse):
                    batch.append(ChoiceEvent(choices[slot].first_index + item.index, item))
                    remaining -= item.last
                    continue
                if isinstance(item, Stalled):
                    failure = APIError(
                        408,
                        f"the client read nothing for {stall_timeout_s:g} s; the request was "
                        "aborted",
                        type="timeout_error",
                    )
                else:
                    failure = from_grpc(item, retry_after_s)
                break
            if batch:
                yield batch
            if failure is not None:
                raise failure
    except grpc.aio.AioRpcError as exc:  # a call that could not be sent
        raise from_grpc(exc, retry_after_s) from None
    finally:
        for s in streams:
            s.cancel()
