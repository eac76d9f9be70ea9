"""Executes StepPlans: keeps per-request state between steps, builds the flattened varlen
batch, runs the model over the paged KV cache and samples.

The control plane owns every decision; this module only follows the plan, in the order
`pagedserve.plan` documents.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.attention import AttentionBackend, BatchLayout
from gpu_worker.kv_cache import KVCache
from gpu_worker.models.llama import CausalLM
from gpu_worker.sampler import Sampler, SamplingRow
from gpu_worker.token_mask import mask_logits
from pagedserve.grammar import GrammarCompiler, Matcher
from pagedserve.log import get_logger
from pagedserve.plan import (
    NewRequestData,
    PromptLogprobRun,
    SampledToken,
    StepPlan,
    StepResult,
)
from pagedserve.sampling_params import InvalidRequestError, SamplingParams, beam_candidates

log = get_logger(__name__)

# glibc mallopt parameters
# Prompt logprobs are computed over at most this many rows at a time (rows x vocab floats).
PROMPT_LOGPROB_ROWS = 256
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_host_memory() -> bool:
    """Asks glibc's malloc to serve large blocks from its heap and to keep what is freed.

    By default every block over a (dynamic) threshold is a fresh mmap, returned to the kernel
    on free: each step's multi-megabyte activations then cost page faults and zeroing, ~10% of
    a CPU forward pass. Process-wide; a no-op (False) where the C library has no mallopt.
    """
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
        )
    except (OSError, AttributeError):
        return False


class PlanError(ValueError):
    """A plan that contradicts the worker's state (unknown request, bad block id, ...)."""


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    matcher: Matcher | None = None  # structured output: where the output stands in its grammar
    # A beam row's last candidates that its grammar refused (masked to -inf: fewer tokens
    # were allowed than the search keeps). A beam forked with one is scored out of the search,
    # and its matcher's error (`outside_grammar`) is the beam's, not its request's.
    refused: frozenset[int] = frozenset()
    outside_grammar: bool = False
    # Failed here (its grammar stopped, or would not compile): plans sent before the control
    # plane learnt it still schedule it, and those rows are left out, until it is finished.
    failed: bool = False

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class _Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    layout: BatchLayout
    sample_rows: torch.Tensor  # [R] flat token row whose logits are sampled
    sample_req_ids: list[str]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        backend: AttentionBackend,
        grammar: Callable[[], GrammarCompiler] | None = None,
    ) -> None:
        """grammar gives the structured-output compiler (None: constrained requests are
        refused)."""
        self.model = model
        self._grammar = grammar
        self.tp = model.tp
        # Rank 0 of a tensor-parallel group samples; the others take its tokens.
        self.samples = self.tp is None or self.tp.samples
        self.cache = cache
        self.backend = backend
        self.sampler = Sampler()
        self.device = cache.kv.device
        self.block_size = cache.geometry.block_size
        self.requests: dict[str, RequestState] = {}
        self.eos_token_ids = tuple(model.config.eos_token_ids)
        if self.device.type == "cpu":
            keep_freed_host_memory()

    def reset(self) -> None:
        """Forgets every request (a new control-plane stream starts from nothing)."""
        self.requests.clear()

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
        self._check_blocks(plan)
        self.cache.swap_out(plan.swap_out)
        self.cache.swap_in(plan.swap_in)
        self.cache.copy_blocks(plan.copy_blocks)
        self._fork_beams(plan)
        result = StepResult(step_id=plan.step_id)
        for new in plan.new_requests:
            st = self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling=new.sampling,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
            try:
                st.matcher = self._matcher(new)
            except (InvalidRequestError, PlanError) as exc:  # its constraint does not compile
                st.failed = True
                result.failed[new.req_id] = str(exc)
        for cached in plan.cached_requests:
            st = self._state(cached.req_id)
            for move in cached.copied:
                st.block_ids[st.block_ids.index(move.src)] = move.dst
            st.block_ids.extend(cached.new_block_ids)

        scheduled = plan.num_scheduled_tokens
        if scheduled:
            t1 = time.perf_counter()
            batch = self._build_batch(scheduled)
            self.backend.begin_step(batch.layout)
            hidden = self.model(batch.input_ids, batch.positions, self.backend.forward)
            states = [self.requests[r] for r in batch.sample_req_ids]
            if states:
                logits = self.model.compute_logits(hidden[batch.sample_rows])
                if self.samples:
                    result.sampled = self._sample(logits, states)
                if self.tp is not None:  # every rank appends rank 0's tokens
                    ids = self.tp.broadcast_tokens(
                        [t.token_id for t in result.sampled.values()] if self.samples else None,
                        len(states),
                    )
                    if not self.samples:
                        result.sampled = {
                            s.req_id: SampledToken(t) for s, t in zip(states, ids, strict=True)
                        }
            result.prompt_logprobs = self._prompt_logprobs(scheduled, hidden)
            for req_id, n in scheduled.items():
                self.requests[req_id].num_computed_tokens += n
            failed = result.failed
            dropped = []
            for req_id, tok in result.sampled.items():
                st = self.requests[req_id]
                if not st.sampling.beam_width:  # a beam's token comes with a later fork
                    # Appended even to a failing request: a plan already on its way may
                    # schedule its next token, and that row must stay valid (on every rank).
                    st.token_ids.append(tok.token_id)
                if st.failed:  # a row planned before the control plane learnt it
                    dropped.append(req_id)
                    continue
                # A matcher in error (its parser's limits reached while its mask was made)
                # allowed only the stop tokens: the token, or a beam's candidates, are no
                # answer, and the request fails.
                if (
                    st.matcher is not None
                    and not st.outside_grammar
                    and (why := st.matcher.error())
                ):
                    failed[req_id] = why
                    continue
                if st.sampling.beam_width:
                    continue
                # A terminated matcher's request has ended (the control plane learns it from
                # this token's predecessor, EOS): a step planned meanwhile samples freely.
                if st.matcher is not None and not st.matcher.terminated:
                    if not st.matcher.accept(tok.token_id):
                        log.error("token_outside_grammar", request_id=req_id, token=tok.token_id)
                        failed[req_id] = st.matcher.error() or "a token outside the grammar"
            for req_id in dropped:
                del result.sampled[req_id]
            for req_id, why in failed.items():
                result.sampled.pop(req_id, None)
                self.requests[req_id].failed = True
                log.warning("structured_output_failed", request_id=req_id, reason=why)
            result.model_time_s = time.perf_counter() - t1
        result.total_time_s = time.perf_counter() - t0
        return result

    def refuse(self, plan: StepPlan, why: str) -> StepResult:
        """The answer to a plan that contradicts this worker's state (PlanError): every request
        it names is forgotten here and refused in the result, so that the control plane fails
        those requests alone and the stream goes on."""
        named = {r.req_id for r in plan.new_requests} | {r.req_id for r in plan.cached_requests}
        named |= plan.num_scheduled_tokens.keys() | {f.req_id for f in plan.beam_forks}
        for req_id in named:
            self.requests.pop(req_id, None)
        return StepResult(step_id=plan.step_id, refused=dict.fromkeys(sorted(named), why))

    def grammar(self) -> GrammarCompiler:
        if self._grammar is None:
            raise PlanError("this worker was started without structured output")
        return self._grammar()

    def _matcher(self, new: NewRequestData) -> Matcher | None:
        """A constrained request's matcher, past the output it already has (a resumed
        request replays its tokens)."""
        if new.sampling.structured is None or not self.samples:
            return None
        matcher = self.grammar().matcher(new.sampling.structured)
        for t in new.output_token_ids:
            if matcher.terminated:
                break
            if not matcher.accept(t):  # the output cannot be continued within the grammar
                log.error("output_outside_grammar", request_id=new.req_id, token=t)
                break
        return matcher

    def _fork_beams(self, plan: StepPlan) -> None:
        """Applies the plan's beam forks, each reading its source as it was before any."""
        if not plan.beam_forks:
            return
        sources = {f.src_req_id: self._state(f.src_req_id) for f in plan.beam_forks}
        for f in plan.beam_forks:
            src = sources[f.src_req_id]
            matcher, outside = None, src.outside_grammar
            if src.matcher is not None:  # each beam advances its own copy past its token
                matcher = src.matcher.fork()
                accepted = matcher.terminated or matcher.accept(f.token_id)
                outside = outside or (not accepted and f.token_id in src.refused)
            self.requests[f.req_id] = RequestState(
                req_id=f.req_id,
                token_ids=[*src.token_ids, f.token_id],
                num_prompt_tokens=src.num_prompt_tokens,
                sampling=src.sampling,
                block_ids=list(src.block_ids),
                num_computed_tokens=src.num_computed_tokens,
                matcher=matcher,
                outside_grammar=outside,
                failed=src.failed,
            )

    def _sample(self, logits: torch.Tensor, states: list[RequestState]) -> dict[str, SampledToken]:
        """One token per sampling row; a beam-search row's top candidates instead."""
        beam = [i for i, s in enumerate(states) if s.sampling.beam_width]
        out: dict[str, SampledToken] = {}
        if len(beam) < len(states):
            rows = [i for i, s in enumerate(states) if not s.sampling.beam_width]
            sampled_states = [states[i] for i in rows]
            sub = logits if not beam else logits[rows]
            self._suppress_early_stops(sub, sampled_states)
            self._constrain(sub, sampled_states)
            sampled = self.sampler(
                sub,
                [
                    SamplingRow(s.sampling, s.token_ids[: s.num_prompt_tokens], s.output_token_ids)
                    for s in sampled_states
                ],
            )
            out.update((s.req_id, t) for s, t in zip(sampled_states, sampled, strict=True))
        if beam:
            rows_of_beams = logits if len(beam) == len(states) else logits[beam]
            out.update(self._beam_candidates(rows_of_beams, [states[i] for i in beam]))
        return {s.req_id: out[s.req_id] for s in states}

    def _beam_candidates(
        self, logits: torch.Tensor, states: list[RequestState]
    ) -> dict[str, SampledToken]:
        """Each beam row's best candidates by float32 log-softmax (transformers' beam
        scores), as many as `beam_candidates` keeps over the whole search."""
        logprobs = logits.float().log_softmax(dim=-1)
        self._constrain(logprobs, states)  # as transformers' logits processors: after it
        num_eos = len(self.eos_token_ids)
        k = max(
            beam_candidates(s.sampling.beam_width, 0 if s.sampling.ignore_eos else num_eos)
            for s in states
        )
        top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
        values, ids = top.values.tolist(), top.indices.tolist()
        out: dict[str, SampledToken] = {}
        for s, v, i in zip(states, values, ids, strict=True):
            n = beam_candidates(s.sampling.beam_width, 0 if s.sampling.ignore_eos else num_eos)
            out[s.req_id] = SampledToken(i[0], v[0], i[:n], v[:n])
            if s.matcher is not None:
                s.refused = frozenset(
                    t for t, x in zip(i[:n], v[:n], strict=True) if x == -math.inf
                )
        return out

    def _prompt_logprobs(
        self, scheduled: dict[str, int], hidden: torch.Tensor
    ) -> dict[str, PromptLogprobRun]:
        """For requests asking for prompt logprobs: each prompt token this step's rows predict
        (the row at position p predicts token p + 1), from the float32 log-softmax of the
        logits, in pieces of PROMPT_LOGPROB_ROWS rows (a long prompt's full logits would be
        rows x vocab floats at once)."""
        runs: dict[str, PromptLogprobRun] = {}
        offset = 0
        for req_id, n in scheduled.items():
            st = self.requests[req_id]
            k = st.sampling.prompt_logprobs
            start = st.num_computed_tokens
            end = min(start + n, st.num_prompt_tokens - 1)
            if k is not None and end > start:
                targets = st.token_ids[start + 1 : end + 1]
                tokens: list[SampledToken] = []
                for a in range(0, end - start, PROMPT_LOGPROB_ROWS):
                    b = min(a + PROMPT_LOGPROB_ROWS, end - start)
                    rows = hidden[offset + a : offset + b]
                    logprobs = self.model.compute_logits(rows).float().log_softmax(dim=-1)
                    ids = torch.tensor(targets[a:b], dtype=torch.long, device=logprobs.device)
                    chosen_t = logprobs.gather(1, ids[:, None])
                    ranks = ((logprobs > chosen_t).sum(dim=1) + 1).tolist()
                    chosen = chosen_t.squeeze(1).tolist()
                    top_v: list[list[float]] = [[] for _ in range(b - a)]
                    top_i: list[list[int]] = [[] for _ in range(b - a)]
                    if k:
                        top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
                        top_v, top_i = top.values.tolist(), top.indices.tolist()
                    tokens += [
                        SampledToken(t, lp, ti, tv, rank)
                        for t, lp, ti, tv, rank in zip(
                            targets[a:b], chosen, top_i, top_v, ranks, strict=True
                        )
                    ]
                runs[req_id] = PromptLogprobRun(start + 1, tokens)
            offset += n
        return runs

    def _constrain(self, logits: torch.Tensor, states: list[RequestState]) -> None:
        """logit_bias, then structured output's masks, in place; nothing for rows without."""
        for i, st in enumerate(states):
            if st.sampling.logit_bias:
                ids, bias = zip(*st.sampling.logit_bias, strict=True)
                index = torch.tensor(ids, dtype=torch.long, device=logits.device)
                values = torch.tensor(bias, dtype=logits.dtype, device=logits.device)
                logits[i].index_add_(0, index, values)
        rows = [i for i, st in enumerate(states) if st.matcher is not None]
        if rows:
            mask_logits(logits, rows, [states[i].matcher for i in rows])  # type: ignore[misc]

    def _suppress_early_stops(self, logits: torch.Tensor, states: list[RequestState]) -> None:
        """Below min_tokens, EOS and stop token ids cannot be sampled."""
        rows: list[int] = []
        cols: list[int] = []
        for i, st in enumerate(states):
            sp = st.sampling
            if sp.min_tokens and len(st.token_ids) - st.num_prompt_tokens < sp.min_tokens:
                stops = set(sp.stop_token_ids)
                if not sp.ignore_eos:
                    stops.update(self.eos_token_ids)
                ids = [t for t in stops if t < logits.shape[1]]
                rows += [i] * len(ids)
                cols += ids
        if rows:
            logits[rows, cols] = float("-inf")

    def profile(self, num_tokens: int) -> None:
        """Runs one prefill of num_tokens tokens so the caller can measure peak memory."""
        blocks = list(range(-(-num_tokens // self.block_size)))
        new = NewRequestData(
            "profile", [0] * num_tokens, [], SamplingParams(temperature=0.0), blocks, 0
        )
        self.execute(StepPlan(0, new_requests=[new], num_scheduled_tokens={"profile": num_tokens}))
        self.reset()

    def _state(self, req_id: str) -> RequestState:
        try:
            return self.requests[req_id]
        except KeyError:
            raise PlanError(f"plan names unknown request {req_id!r}") from None

    def _check_blocks(self, plan: StepPlan) -> None:
        limit = self.cache.num_gpu_blocks
        ids = [b for r in plan.new_requests for b in r.block_ids]
        ids += [b for r in plan.cached_requests for b in r.new_block_ids]
        ids += [m.dst for r in plan.cached_requests for m in r.copied]
        ids += [m.src for m in plan.swap_out] + [m.dst for m in plan.swap_in]
        ids += [b for m in plan.copy_blocks for b in m]
        if any(b >= limit for b in ids):
            raise PlanError(f"plan names a block id outside the pool of {limit} blocks")
        cpu_limit = self.cache.num_cpu_blocks
        if any(m.dst >= cpu_limit for m in plan.swap_out) or any(
            m.src >= cpu_limit for m in plan.swap_in
        ):
            raise PlanError(f"plan names a swap block outside the pool of {cpu_limit} blocks")

    def _build_batch(self, scheduled: dict[str, int]) -> _Batch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        q_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_req_ids: list[str] = []
        for req_id, n in scheduled.items():
            st = self._state(req_id)
            start = st.num_computed_tokens
            end = start + n
            if n < 1 or end > len(st.token_ids):
                raise PlanError(
                    f"request {req_id!r}: {n} tokens scheduled from {start}, "
                    f"but it has {len(st.token_ids)} tokens"
                )
            if end > len(st.block_ids) * bs:
                raise PlanError(f"request {req_id!r}: block table too short for {end} tokens")
            input_ids.extend(st.token_ids[start:end])
            positions.extend(range(start, end))
            table = st.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            q_lens.append(n)
            seq_lens.append(end)
            tables.append(table)
            if end == len(st.token_ids):
                sample_rows.append(query_start[-1] - 1)
                sample_req_ids.append(req_id)

        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        layout = BatchLayout(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            query_lens_host=q_lens,
            seq_lens_host=seq_lens,
        )
        return _Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            layout=layout,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            sample_req_ids=sample_req_ids,
        )
