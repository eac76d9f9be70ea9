"""The control plane's domain: the workers it drives (registration as they answer), admission
(limits, budgets, the waiting bound), placement, and moving a lost worker's requests.

No gRPC service code here: `control_plane.servicer` maps these calls to the ControlPlane
service, and `control_plane.grpc_errors` their errors to status codes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from control_plane.config import ControlPlaneConfig
from control_plane.engine import EngineLoop
from control_plane.grammar_check import GrammarChecker, GrammarTimeout
from control_plane.prefix_index import MemoryPrefixIndex, PrefixIndex, RedisPrefixIndex
from control_plane.request import RequestStatus
from control_plane.router import Router
from control_plane.scheduler import SchedulerConfig
from control_plane.tokenizer import LoadedTokenizer, load_tokenizer
from control_plane.worker_client import WorkerClient
from pagedserve import grammar
from pagedserve.log import get_logger
from pagedserve.sampling_params import InvalidRequestError, SamplingParams, StructuredOutput
from protos.v1 import worker_pb2

log = get_logger(__name__)

# Registering a listed worker: each try waits this long for an answer, then the next try
# follows after a back-off doubling from the minimum to the maximum.
WORKER_DESCRIBE_TIMEOUT_S = 2.0
WORKER_RETRY_MIN_S = 0.2
WORKER_RETRY_MAX_S = 2.0
WAITING_LOG_INTERVAL_S = 10.0
REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
# Prompts are tokenized on these threads, never on the event loop the engine loops share; the
# tokenizer releases the GIL, and two threads bound the CPU a burst of long prompts can take.
TOKENIZE_THREADS = 2
GRAMMAR_CHECK_PROCESSES = 2


class StartupError(RuntimeError):
    """The control plane cannot start serving; its message is one line for the operator."""


class WorkersUnreachable(StartupError):
    """No listed worker answered within the startup wait."""


class AdmissionError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def logprob_entries(num_prompt_tokens: int, sampling: SamplingParams) -> int:
    """The most logprob entries a request returns: each generated token's own and its
    `logprobs` alternatives, for n completions, and each prompt token's and its
    `prompt_logprobs` alternatives (sent once)."""
    entries = 0
    if sampling.logprobs is not None:
        entries += sampling.n * sampling.max_tokens * (1 + sampling.logprobs)
    if sampling.prompt_logprobs is not None:
        entries += num_prompt_tokens * (1 + sampling.prompt_logprobs)
    return entries


class ControlPlane:
    """Admission, placement and the per-worker engine loops."""

    def __init__(self, config: ControlPlaneConfig) -> None:
        self.config = config
        self.loops: list[EngineLoop] = []
        self.tokenizer: LoadedTokenizer | None = None
        self.model_name = ""
        self.info: worker_pb2.WorkerInfo | None = None
        self.router: Router | None = None
        self.pending: set[str] = set(config.workers)  # listed workers not registered yet
        self._registering: list[asyncio.Task[None]] = []
        self._registered = asyncio.Event()  # the first worker has registered (or failed to)
        self._register_lock = asyncio.Lock()
        self._startup_error: BaseException | None = None
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
        # Structured output: constraints are parsed (checked) in these child processes.
        self._grammar_checker = GrammarChecker(
            GRAMMAR_CHECK_PROCESSES, config.grammar_compile_timeout_s
        )
        self._checked: dict[StructuredOutput, InvalidRequestError | None] = {}
        # Compilations asked of each worker (a done task: compiled there).
        self._prepared: dict[tuple[str, int, StructuredOutput], asyncio.Future[None]] = {}

    async def connect(self) -> None:
        """Registers the listed workers as they answer, each retried with a back-off of at
        most WORKER_RETRY_MAX_S. Returns once the first one has registered: the control plane
        serves with the workers it has, and the others join when they come up. Raises
        WorkersUnreachable when none answers within worker_connect_timeout_s (0: no limit)."""
        log.info("waiting_for_workers", workers=sorted(self.pending))
        self._registering = [
            asyncio.create_task(self._register(address), name=f"register-{address}")
            for address in self.config.workers
        ]
        timeout = self.config.worker_connect_timeout_s or None
        try:
            await asyncio.wait_for(self._registered.wait(), timeout)
        except TimeoutError:
            raise WorkersUnreachable(
                f"no worker answered within {timeout:.0f} s (--worker-connect-timeout): "
                f"{', '.join(sorted(self.pending))}"
            ) from None
        if self._startup_error is not None:
            raise self._startup_error

    @property
    def serving(self) -> bool:
        """At least one worker is registered and answering: what both health endpoints say."""
        return any(loop.healthy for loop in self.loops)

    async def _register(self, address: str) -> None:
        client = WorkerClient(address, security=self.config.grpc_security)
        delay = WORKER_RETRY_MIN_S
        last_log = -WAITING_LOG_INTERVAL_S
        while True:
            try:
                info = await client.describe(timeout=WORKER_DESCRIBE_TIMEOUT_S)
                break
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() - last_log >= WAITING_LOG_INTERVAL_S:
                    last_log = time.monotonic()
                    if exc.code() in REFUSALS:  # it answers, but not to us: a setup error
                        log.error("worker_refuses", worker=address, error=exc.details())
                    else:
                        log.info("waiting_for_worker", worker=address, status=exc.code().name)
                await asyncio.sleep(delay)
                delay = min(2 * delay, WORKER_RETRY_MAX_S)
        try:
            async with self._register_lock:
                await self._add_worker(client, info)
        except Exception as exc:
            await client.close()
            if self.info is None:  # nothing can be served without the first worker's model
                self._startup_error = StartupError(
                    f"cannot serve the model of worker {address}: {exc}"
                )
                self._registered.set()
            else:
                log.error("worker_refused", worker=address, error=str(exc))

    async def _add_worker(self, client: WorkerClient, info: worker_pb2.WorkerInfo) -> None:
        first = self.info
        if first is None:
            self.model_name = self.config.served_model_name or info.model
            self.tokenizer = await asyncio.to_thread(
                load_tokenizer, self.config.tokenizer or info.model_path, self.config.chat_template
            )
        elif (info.architecture, info.vocab_size) != (first.architecture, first.vocab_size):
            raise RuntimeError(
                f"it serves {info.model} ({info.architecture}, vocab {info.vocab_size}), the "
                f"cluster {first.model} ({first.architecture}, vocab {first.vocab_size}): all "
                "workers must serve the same model"
            )
        assert self.tokenizer is not None
        sched_cfg = SchedulerConfig(
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=info.max_model_len,
            preemption_mode=self.config.preemption,
            eos_token_ids=tuple(info.eos_token_ids),
            long_prefill_token_threshold=self.config.long_prefill_token_threshold,
            max_prefill_tokens_with_decodes=self.config.max_prefill_tokens_with_decodes,
        )
        loop = EngineLoop(
            client,
            info,
            sched_cfg,
            self.tokenizer,
            self.config.enable_prefix_caching,
            self.config.async_scheduling,
        )
        loop.hand_off = self.take_over
        loop.failover_after_s = self.config.worker_failover_s
        if self.config.step_trace:
            loop.trace_steps(self.config.step_trace)
        if self.router is None:
            index: PrefixIndex = (
                RedisPrefixIndex(self.config.redis_url, self.model_name)
                if self.config.redis_url
                else MemoryPrefixIndex()
            )
            self.router = Router([loop], index, info.block_size)
            await self.router.start()
        else:
            await self.router.add(loop)
        loop.start()
        self.loops.append(loop)
        # In the order the workers are listed, whichever registered first (stats, tie-breaks).
        self.loops.sort(key=lambda lp: self.config.workers.index(lp.client.address))
        self.pending.discard(client.address)
        if first is None:
            self.info = info
        log.info(
            "worker_registered",
            worker=client.address,
            model=info.model,
            num_gpu_blocks=info.num_gpu_blocks,
            epoch=info.epoch,
            waiting_for=sorted(self.pending),
        )
        self._registered.set()

    async def close(self) -> None:
        for task in self._registering:
            task.cancel()
        await asyncio.gather(*self._registering, return_exceptions=True)
        if self.router is not None:
            await self.router.close()
        for loop in self.loops:
            await loop.stop()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        await self._grammar_checker.close()

    # -- admission ----------------------------------------------------------------------------

    async def admit(
        self,
        req_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        cache_salt: str | None,
        batch_id: str = "",
    ) -> EngineLoop:
        """Rejects what can never be served, then places the request on a worker. A request of
        a batch (`batch_id`) whose other requests are already admitted is queued with them."""
        info = self.info
        assert info is not None
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if any(t >= info.vocab_size for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be < vocab size {info.vocab_size}")
        if n >= info.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; the model's maximum context length is "
                f"{info.max_model_len} tokens, and at least one must be left to generate"
            )
        if n + sampling.max_tokens > info.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
                f"maximum context length of {info.max_model_len} tokens"
            )
        blocks = -(-(n + sampling.max_tokens) // info.block_size)
        if blocks > info.num_gpu_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens needs {blocks} KV blocks of {info.block_size} tokens, "
                f"more than the whole KV cache of {info.num_gpu_blocks} blocks"
            )
        self.check_budget(n, sampling)
        if any(t >= info.vocab_size for t, _ in sampling.logit_bias):
            raise InvalidRequestError(
                f"logit_bias token ids must be < vocab size {info.vocab_size}"
            )
        if sampling.structured is not None:
            await self.check_constraint(sampling.structured)
        if "#" in req_id:
            raise InvalidRequestError("request ids must not contain '#'")
        if not self.serving:
            raise AdmissionError(grpc.StatusCode.UNAVAILABLE, "no worker is answering")
        assert self.router is not None
        loop = await self.router.place(prompt_ids, cache_salt)
        if sampling.structured is not None:
            await self.prepare_constraint(loop, sampling.structured)
        # Checked after the last await, so nothing can slip in between check and add.
        if any(req_id in lp.streams for lp in self.loops):
            raise AdmissionError(grpc.StatusCode.ALREADY_EXISTS, f"request {req_id} is running")
        loop = self._within_queue_delay(loop, n, max(1, sampling.beam_width or sampling.n))
        waiting = sum(lp.scheduler.num_waiting for lp in self.loops)
        limit = self.waiting_limit()
        if waiting >= limit and not self._batch_admitted(batch_id):
            raise AdmissionError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the waiting queue is full ({waiting} requests, limit {limit}"
                f"{'' if self.config.max_waiting is not None else ', --max-num-seqs per worker'}"
                "; --max-waiting sets it); retry later",
            )
        return loop

    def _batch_admitted(self, batch_id: str) -> bool:
        """Whether another request of this batch is running or waiting: the batch passed the
        waiting queue's limit at its first request."""
        return bool(batch_id) and any(
            s.batch_id == batch_id for lp in self.loops for s in lp.streams.values()
        )

    def _within_queue_delay(self, loop: EngineLoop, prompt_tokens: int, seats: int) -> EngineLoop:
        """The placed worker, or the healthy one where the request would wait least, if it
        would wait no longer than --max-queue-delay for its first token; else 429 at once."""
        limit = self.config.max_queue_delay_s
        if limit is None:
            return loop
        delay = loop.queue_delay_s(prompt_tokens, seats)
        if delay > limit:
            for other in self.loops:
                if other is not loop and other.healthy:
                    d = other.queue_delay_s(prompt_tokens, seats)
                    if d < delay:
                        loop, delay = other, d
        if delay <= limit:
            return loop
        why = (
            "no seat or KV space is free until a running request finishes"
            if math.isinf(delay)
            else f"its first token would wait about {delay * 1e3:.0f} ms behind other requests"
        )
        raise AdmissionError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the server is at capacity: {why}, more than --max-queue-delay "
            f"({limit * 1e3:g} ms) allows; retry later",
        )

    def check_budget(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        """Refuses a request that asks for more generated tokens (n x max_tokens) or more
        logprob entries than one request may have (--max-request-tokens,
        --max-logprob-entries): what a request returns is held here, then in the gateway,
        whole for a non-streaming one, so a few bytes of request must not ask for gigabytes."""
        cfg = self.config
        tokens = sampling.n * sampling.max_tokens
        if tokens > cfg.max_request_tokens:
            raise InvalidRequestError(
                f"n ({sampling.n}) x max_tokens ({sampling.max_tokens}) = {tokens} tokens is "
                f"more than one request may generate ({cfg.max_request_tokens}; the control "
                "plane's --max-request-tokens raises it)"
            )
        entries = logprob_entries(num_prompt_tokens, sampling)
        if entries > cfg.max_logprob_entries:
            raise InvalidRequestError(
                f"this request would return {entries} logprob entries (n x max_tokens x "
                "(1 + logprobs), + prompt tokens x (1 + prompt_logprobs)), more than one request "
                f"may ({cfg.max_logprob_entries}; the control plane's --max-logprob-entries "
                "raises it)"
            )

    def default_max_tokens(
        self, num_prompt_tokens: int, n: int, logprobs: int | None, prompt_logprobs: int | None
    ) -> int:
        """A chat request's max_tokens when it sets none: the rest of the context, as in
        OpenAI's API, within the per-request budget."""
        most = min(self.room_after(num_prompt_tokens), self.config.max_request_tokens // n)
        if logprobs is not None:
            prompt = 0 if prompt_logprobs is None else num_prompt_tokens * (1 + prompt_logprobs)
            most = min(most, (self.config.max_logprob_entries - prompt) // (n * (1 + logprobs)))
        return max(1, most)

    async def check_constraint(self, constraint: StructuredOutput) -> None:
        """Parses a structured-output constraint (cached, refusals too): InvalidRequestError
        naming the field and the reason for one that cannot compile, before any worker sees
        it."""
        if constraint not in self._checked:
            try:
                self._checked[constraint] = await self._grammar_checker.check(constraint)
            except GrammarTimeout:  # not kept: a loaded moment is no verdict on the constraint
                raise self._too_slow(constraint) from None
            while len(self._checked) > grammar.CACHE_SIZE:
                del self._checked[next(iter(self._checked))]
        if (refusal := self._checked.get(constraint)) is not None:
            raise refusal

    async def prepare_constraint(self, loop: EngineLoop, constraint: StructuredOutput) -> None:
        """Has the request's worker compile its constraint off its model thread (cached there),
        so that scheduling it never waits for a compilation; one slower than
        --grammar-compile-timeout is refused. A worker that cannot be asked (it is failing)
        compiles when the request first runs."""
        timeout = self.config.grammar_compile_timeout_s
        # One call per worker (and epoch: a restarted one has an empty cache) and constraint:
        # a burst of requests with a new schema waits for the same compilation.
        key = (loop.client.address, loop.info.epoch, constraint)
        task = self._prepared.get(key)
        if task is None:
            task = asyncio.ensure_future(loop.client.prepare_grammar(constraint, timeout))
            self._prepared[key] = task
            while len(self._prepared) > grammar.CACHE_SIZE:
                del self._prepared[next(iter(self._prepared))]
        try:
            await asyncio.shield(task)
        except grpc.aio.AioRpcError as exc:
            if self._prepared.get(key) is task:
                del self._prepared[key]  # asked again next time
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequestError(
                    exc.details() or "the constraint does not compile"
                ) from None
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise self._too_slow(constraint) from None
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise AdmissionError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "the worker is busy compiling other constraints; retry shortly",
                ) from None

    def _too_slow(self, constraint: StructuredOutput) -> InvalidRequestError:
        return InvalidRequestError(
            f"{constraint.kind} did not compile within {self.config.grammar_compile_timeout_s:g} s "
            "(--grammar-compile-timeout)"
        )

    def waiting_limit(self) -> int:
        """How many requests may wait. `--max-waiting N` fixes it; by default it is one batch
        per healthy worker, --max-num-seqs each: what the scheduler may run at once.

        A burst that an idle cluster would take into its running batches is queued whole, never
        refused, whatever the KV pools hold: the pool only decides how many of them start at
        once, and they start in turn as blocks free up. It is also at least what the queue-delay
        estimate (--max-queue-delay) admits, which needs a free seat (control_plane.admission).
        Beyond one batch waiting per worker the client hears 429 at once, since a request
        behind it would wait for a whole batch to finish first."""
        if self.config.max_waiting is not None:
            return self.config.max_waiting
        healthy = sum(1 for loop in self.loops if loop.healthy)
        return max(1, healthy) * self.config.max_num_seqs

    async def wait_ready(self) -> None:
        """Returns once the first worker has registered (the model is unknown before): at once
        when one has, else as soon as one does, waiting at most --worker-wait-timeout seconds;
        past that, UNAVAILABLE naming the workers waited for. The wait is on the event that
        registration sets, so a waiting request holds no lock and polls nothing; a client that
        cancels, or whose deadline passes, ends its wait (gRPC cancels the call's task)."""
        if self.info is not None:
            return
        timeout = self.config.worker_wait_timeout_s
        if timeout > 0:
            try:
                await asyncio.wait_for(self._registered.wait(), timeout)
            except TimeoutError:
                pass
        if self.info is None:
            raise AdmissionError(
                grpc.StatusCode.UNAVAILABLE,
                f"no worker is ready (waited {timeout:g} s for "
                f"{', '.join(sorted(self.pending))}; --worker-wait-timeout)",
            )

    async def tokenize(
        self, text: str, add_special_tokens: bool, literal: Sequence[tuple[int, int]] = ()
    ) -> list[int]:
        """Token ids of a prompt, off the event loop; special-token text inside the `literal`
        spans (chat message contents) is tokenized as text. A text longer than any context
        could hold is refused before a thread spends a moment on it."""
        tok, info = self.tokenizer, self.info
        assert tok is not None and info is not None
        limit = info.max_model_len * tok.max_token_chars
        if len(text) > limit:
            raise InvalidRequestError(
                f"the prompt has {len(text)} characters; the model's maximum context length of "
                f"{info.max_model_len} tokens holds at most {limit} characters"
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenize_pool, tok.encode, text, add_special_tokens, literal
        )

    def abort(self, req_id: str) -> bool:
        return any(loop.abort(req_id) for loop in self.loops)

    def take_over(self, lost: EngineLoop) -> bool:
        """Moves every request of a worker that stopped answering to the least-loaded healthy
        worker, from its prompt plus the tokens already streamed."""
        healthy = [loop for loop in self.loops if loop is not lost and loop.healthy]
        if not healthy:
            return False
        for client_id, stream in list(lost.streams.items()):
            target = min(healthy, key=lambda loop: loop.load)
            requests = lost.live_copies(client_id)
            lost.scheduler.finish_requests([client_id], RequestStatus.FINISHED_ABORTED)
            del lost.streams[client_id]
            target.adopt(stream, requests)
            log.info("request_moved", request_id=client_id, to=target.client.address)
        return True

    def room_after(self, num_prompt_tokens: int) -> int:
        """Most tokens a prompt of this length may generate (context and KV pool permitting)."""
        info = self.info
        assert info is not None
        pool = info.num_gpu_blocks * info.block_size
        return max(1, min(info.max_model_len, pool) - num_prompt_tokens)
