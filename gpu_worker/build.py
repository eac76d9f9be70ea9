"""Builds a worker rank: loads its model (its shard under tensor parallelism), sizes its KV
pool and makes its runner. Every rank is built here the same way; rank 0's server
(`gpu_worker.server`) and the other ranks (`gpu_worker.follower`) each wrap the result.
"""

from __future__ import annotations

import math
import time
from concurrent import futures
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gpu_worker import affinity, cpu_isa, cpu_team, host_memory
from gpu_worker.affinity import unbind_this_thread
from gpu_worker.attention import create_backend
from gpu_worker.checkpoint import load_config, load_model, model_name, size_on_disk
from gpu_worker.config import (
    DEFAULT_KV_CACHE_CAP,
    DEFAULT_KV_CACHE_SHARE,
    DTYPES,
    WorkerConfig,
    default_kv_cache_memory,
)
from gpu_worker.cpu_team import CpuTeam
from gpu_worker.kv_cache import CacheGeometry, KVCache
from gpu_worker.model_runner import ModelRunner, PlanError
from gpu_worker.models.llama import CausalLM, pack_dtype
from gpu_worker.models.shard import Shard
from gpu_worker.parallel.followers import Followers
from gpu_worker.parallel.group import TPGroup
from gpu_worker.team import TeamSizer
from pagedserve.grammar import GrammarCompiler, vocab_tokenizer
from pagedserve.log import get_logger, human_bytes
from pagedserve.ports import free_port
from protos.v1 import worker_pb2

log = get_logger(__name__)


class WorkerStartupError(RuntimeError):
    """The worker cannot start as configured (said in one line; nothing was served)."""


@dataclass
class Worker:
    config: WorkerConfig
    runner: ModelRunner
    info: worker_pb2.WorkerInfo
    followers: Followers | None = None  # tensor parallelism: ranks 1..N-1 (on rank 0)
    team: TeamSizer | None = None  # the adaptive team size (gpu_worker.team), where enabled
    cpu_team: CpuTeam | None = None  # the projections' stall-free team, where it runs

    def reset(self) -> None:
        if self.followers is not None:
            self.followers.send_reset()
        self.runner.reset()


def start_worker(cfg: WorkerConfig) -> Worker:
    """Builds the worker the control plane talks to: under tensor parallelism, ranks 1..N-1 are
    started first (`Followers`), then rank 0 is built and holds their handle."""
    if cfg.tensor_parallel_size == 1:
        return build_worker(cfg)
    # A split that cannot work is said before any rank starts.
    Shard.plan(load_config(cfg.model), 0, cfg.tensor_parallel_size)
    port = free_port()
    followers = Followers(cfg, cfg.tensor_parallel_size, port)
    try:
        worker = build_worker(cfg, rank=0, tp_port=port)
    except ValueError:  # a checkpoint, a dtype or a pool size that cannot be served
        followers.stop()
        raise
    worker.followers = followers
    followers.watch()
    return worker


def build_worker(cfg: WorkerConfig, rank: int = 0, tp_port: int | None = None) -> Worker:
    """Loads the model (rank `rank`'s shard under tensor parallelism, joining the group at
    127.0.0.1:`tp_port`) and sizes its KV pool."""
    tp = None
    threads = cfg.num_threads
    if cfg.tensor_parallel_size > 1:
        assert tp_port is not None
        if cfg.device.startswith("cuda"):  # rank r on visible device r
            cfg = replace(cfg, device=f"cuda:{rank}")
            torch.cuda.set_device(rank)
        shard = Shard.plan(load_config(cfg.model), rank, cfg.tensor_parallel_size)
        tp = TPGroup.join(shard, tp_port, cfg.device)
        threads = max(1, (threads or torch.get_num_threads()) // cfg.tensor_parallel_size)
    if threads:
        torch.set_num_threads(threads)
    dtype = cfg.torch_dtype
    team = torch.get_num_threads()
    # A bf16 model whose products are widened to float32 (a CPU without bf16 products).
    products = pack_dtype(dtype, torch.device(cfg.device))
    widened = dtype == torch.bfloat16 and products == torch.float32
    running: CpuTeam | None = None
    if tp is None and cpu_team.wanted(cfg.device, dtype, team, affinity.is_bound(), widened):
        # The projections' team: the model's thread and helpers that never stall it; torch's
        # own ops keep to the model's thread (docs/architecture.md, "The CPU team").
        running = cpu_team.start(affinity.other_cores(team - 1))
        if running is not None:
            torch.set_num_threads(1)
        helpers = 0 if running is None else running.width - 1
        log.info("cpu_team", helpers=helpers, threads=team, tiles=cpu_team.tiles())
    elif dtype == torch.bfloat16 and (asked := cpu_team.tiles_asked()):
        # No team (threads not bound, more than MAX_THREADS, tensor parallel) or no tiles
        # (Linux refused AMX's state, a build without the intrinsics): oneDNN keeps them.
        log.warning("cpu_team_tiles_unused", asked=asked, threads=team, bound=affinity.is_bound())
    if cfg.device != "cpu" and cfg.cache_dtype != cfg.model_dtype:
        raise ValueError("a KV cache dtype other than the model's is supported on CPU only")
    isa = cpu_isa.bf16_isa() if cfg.device == "cpu" else None
    log.info(
        "dtype_chosen",
        dtype=cfg.model_dtype,
        requested=cfg.dtype,
        kv_cache_dtype=cfg.cache_dtype,
        device=cfg.device,
        cpu_bf16_isa=isa or "none",
    )
    path = Path(cfg.model).resolve()
    log.info(
        "model_loading",
        path=str(path),
        size=human_bytes(size_on_disk(path)),
        dtype=cfg.model_dtype,
        device=cfg.device,
    )
    t0 = time.perf_counter()
    model = load_model(cfg.model, dtype=dtype, device=cfg.device, tp=tp)
    log.info(
        "model_loaded",
        architecture=model.config.architecture,
        parameters=f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M",
        projections=model.projection_path(),
        seconds=round(time.perf_counter() - t0, 2),
    )
    t0 = time.perf_counter()
    if calls := model.warm_up(cfg.warmup_batch_size):
        log.info("kernels_warmed_up", calls=calls, seconds=round(time.perf_counter() - t0, 2))
    mc = model.config
    # The whole model's pool geometry sizes the pool (the same block count on every rank, so
    # block ids mean the same everywhere); each rank holds its KV heads' part of every block.
    whole = CacheGeometry(
        num_layers=mc.num_hidden_layers,
        num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        block_size=cfg.block_size,
        dtype=DTYPES[cfg.cache_dtype],
    )
    geometry = whole if tp is None else replace(whole, num_kv_heads=tp.shard.num_kv_heads)
    num_heads = mc.num_attention_heads if tp is None else tp.shard.num_heads
    num_gpu_blocks = _num_device_blocks(cfg, whole, geometry, model, num_heads)
    num_cpu_blocks = whole.num_blocks_for(cfg.swap_space)
    if tp is not None:  # on CUDA each rank measured its own device
        num_gpu_blocks = tp.min(num_gpu_blocks)
    cache = KVCache(geometry, num_gpu_blocks, num_cpu_blocks, cfg.device)
    _log_pools(cache, cfg)
    backend = create_backend(cfg.attention_backend, cache, num_heads, mc.head_dim, cfg.device)
    max_model_len = mc.max_model_len
    if cfg.max_model_len is not None:
        max_model_len = min(max_model_len, cfg.max_model_len)
    info = worker_pb2.WorkerInfo(
        model=cfg.served_model_name or model_name(cfg.model),
        model_path=str(Path(cfg.model).resolve()),
        architecture=mc.architecture,
        dtype=cfg.model_dtype,
        kv_cache_dtype=cfg.cache_dtype,
        cpu_bf16_isa=isa or "",
        device=cfg.device,
        block_size=cfg.block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_model_len=max_model_len,
        eos_token_ids=list(mc.eos_token_ids),
        epoch=time.time_ns(),
        vocab_size=mc.vocab_size,
        attention_backend=backend.name,
        kv_cache_bytes=cache.nbytes * cfg.tensor_parallel_size,
        tensor_parallel_size=cfg.tensor_parallel_size,
    )
    if tp is not None and not tp.samples:  # a follower: rank 0 samples and matches grammars
        return Worker(cfg, ModelRunner(model, cache, backend), info)
    # The structured-output compiler (~1 s for a 50k vocabulary) is built while the worker
    # warms up; the first constrained request waits for it if it comes sooner.
    grammar = futures.ThreadPoolExecutor(
        1, thread_name_prefix="grammar", initializer=unbind_this_thread
    ).submit(lambda: GrammarCompiler(vocab_tokenizer(cfg.model), mc.vocab_size, mc.eos_token_ids))

    def grammar_compiler() -> GrammarCompiler:
        try:
            return grammar.result()
        except (OSError, ValueError, RuntimeError) as exc:
            raise PlanError(f"structured output is unavailable on this worker: {exc}") from exc

    return Worker(
        cfg,
        ModelRunner(model, cache, backend, grammar_compiler),
        info,
        team=_team_sizer(cfg, running),
        cpu_team=running,
    )


def _team_sizer(cfg: WorkerConfig, running: CpuTeam | None) -> TeamSizer | None:
    """The adaptive team size where the worker's threads are bound one to a core (one rank on
    the CPU, its thread count left to the default) and there are two or more of them."""
    whole = torch.get_num_threads()
    if running is not None:  # its helpers never hold a step up: nothing to size
        return None
    if not cfg.adaptive_threads or cfg.device != "cpu" or cfg.tensor_parallel_size != 1:
        return None
    if whole < 2:
        return None
    log.info("threads_adaptive", sizes=[whole - 1, whole])
    return TeamSizer((whole - 1, whole))


def _log_pools(cache: KVCache, cfg: WorkerConfig) -> None:
    """The KV pool and the swap pool, each in blocks, tokens and bytes."""
    g = cache.geometry
    for event, where, blocks in (
        ("kv_cache_allocated", cfg.device, cache.num_gpu_blocks),
        ("swap_pool_allocated", "cpu", cache.num_cpu_blocks),
    ):
        log.info(
            event,
            device=where,
            blocks=blocks,
            tokens=blocks * g.block_size,
            size=human_bytes(blocks * g.bytes_per_block),
            block_size=g.block_size,
            dtype=cfg.cache_dtype,
        )


def _num_device_blocks(
    cfg: WorkerConfig,
    whole: CacheGeometry,
    geometry: CacheGeometry,
    model: CausalLM,
    num_heads: int,
) -> int:
    """KV blocks of the pool: what --kv-cache-memory holds of the whole model's blocks (split
    over the ranks under tensor parallelism); without it, on CPU what default_kv_cache_memory
    allows of the host memory still available, on CUDA what this device has left for its
    rank's `geometry` under --gpu-memory-utilization. Logs the size and why (kv_cache_sized)."""
    if cfg.kv_cache_memory is not None:
        log.info("kv_cache_sized", size=human_bytes(cfg.kv_cache_memory), by="--kv-cache-memory")
        blocks = whole.num_blocks_for(cfg.kv_cache_memory)
        if cfg.device != "cpu":  # this rank's part of them must fit beside the weights
            free, _ = torch.cuda.mem_get_info(cfg.device)
            if (need := blocks * geometry.bytes_per_block) > free:
                raise WorkerStartupError(
                    f"--kv-cache-memory {human_bytes(cfg.kv_cache_memory)} needs"
                    f" {human_bytes(need)} on {cfg.device}, which has {human_bytes(free)} free"
                    " after the weights"
                )
        return blocks
    if cfg.device == "cpu":
        available = host_memory.available_bytes()
        budget = default_kv_cache_memory(available)
        log.info(
            "kv_cache_sized",
            size=human_bytes(budget),
            by=(
                f"min({human_bytes(DEFAULT_KV_CACHE_CAP)}, {DEFAULT_KV_CACHE_SHARE:.0%} of the "
                "available host memory); --kv-cache-memory sets it"
                if available is not None
                else "the available host memory is unknown; --kv-cache-memory sets it"
            ),
            available=None if available is None else human_bytes(available),
        )
        return whole.num_blocks_for(budget)
    # CUDA: what the utilization budget leaves after the weights and a profiling pass of one
    # max-size prefill (activations), measured rather than guessed.
    torch.cuda.reset_peak_memory_stats(cfg.device)
    n = cfg.max_num_batched_tokens
    probe = KVCache(geometry, math.ceil(n / geometry.block_size), 0, cfg.device)
    backend = create_backend(cfg.attention_backend, probe, num_heads, geometry.head_dim, cfg.device)
    runner = ModelRunner(model, probe, backend)
    runner.profile(n)
    peak = torch.cuda.max_memory_allocated(cfg.device) - probe.nbytes
    del runner, backend, probe
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(cfg.device)
    budget = int(total * cfg.gpu_memory_utilization) - peak
    log.info(
        "kv_cache_sized",
        size=human_bytes(max(0, budget)),
        by=f"--gpu-memory-utilization {cfg.gpu_memory_utilization:g} of {human_bytes(total)}, "
        f"less {human_bytes(peak)} of weights and activations",
    )
    return geometry.num_blocks_for(budget)
