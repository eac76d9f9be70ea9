"""The control plane's replies as protobuf: a completion's chunk with its logprobs, and the
counters `Stats` reports."""

from __future__ import annotations

from control_plane.engine import OutputChunk
from control_plane.plane import ControlPlane
from control_plane.tokenizer import LoadedTokenizer
from pagedserve import wire
from pagedserve.plan import SampledToken
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb


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


def chunk_to_proto(
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
