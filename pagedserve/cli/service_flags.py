"""The flag groups of the services: a worker's, the control plane's scheduler, the gateway's.
`up` takes all three."""

from __future__ import annotations

import argparse

from pagedserve.cli.flags import count_or_auto, env_flag, parse_bytes, seconds_or_off


def worker_flags(p: argparse.ArgumentParser) -> None:
    env_flag(p, "--device", default="cpu", help="cpu or cuda[:N]")
    dtypes = ["float32", "bfloat16", "float16", "float64"]
    env_flag(
        p,
        "--dtype",
        default="auto",
        choices=["auto", *dtypes],
        help="auto: bfloat16 on CUDA and on CPUs with AMX / AVX512-BF16, else float32",
    )
    env_flag(
        p,
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", *dtypes],
        help="the KV cache's dtype (auto: the model's)",
    )
    env_flag(p, "--block-size", type=int, default=16, help="tokens per KV block")
    env_flag(
        p,
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="bytes of KV cache (e.g. 2GiB); default on CPU a quarter of the host memory "
        "available once the model is loaded, at most 4GiB (pages are taken as blocks are "
        "written), and on CUDA what --gpu-memory-utilization leaves",
    )
    env_flag(
        p,
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights, activations and KV cache (unused where "
        "--kv-cache-memory is given)",
    )
    env_flag(p, "--swap-space", type=parse_bytes, default=1 << 30, help="bytes of host swap pool")
    env_flag(
        p,
        "--attention-backend",
        choices=["torch", "triton"],
        default=None,
        help="default: triton on CUDA, torch on CPU",
    )
    env_flag(p, "--max-model-len", type=int, default=None, help="cap the context length")
    env_flag(p, "--num-threads", type=int, default=None, help="torch intra-op threads")
    env_flag(
        p,
        "--no-adaptive-threads",
        action="store_true",
        help="on a CPU, run every step on every core: no measuring whether one thread fewer "
        "(a core left to the other processes) serves faster",
    )
    env_flag(
        p,
        "--nice",
        type=int,
        default=None,
        help="lower the CPU priority of the worker's model threads by this much, so the gateway "
        "and control plane on the same cores answer first (default: 10 on a CPU, 0 on CUDA)",
    )
    env_flag(
        p,
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="rank processes the model is split over (its heads, MLP columns, vocabulary and "
        "KV heads); the threads are shared among them",
    )
    env_flag(
        p,
        "--warmup-batch-size",
        type=int,
        default=128,
        help="build the CPU projection kernels for batches of 1..N rows at startup (0: none)",
    )


def scheduler_flags(p: argparse.ArgumentParser) -> None:
    from control_plane.config import DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES

    env_flag(p, "--max-num-seqs", type=int, default=256, help="sequences per step")
    env_flag(p, "--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    env_flag(
        p,
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="chunk any prefill longer than this many tokens per step",
    )
    env_flag(
        p,
        "--max-prefill-tokens-with-decodes",
        type=int,
        default=DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES,
        help="prompt tokens of a step that also carries decodes (a streamed token's longest "
        "gap); a step without decodes takes --max-num-batched-tokens (as large: no cap)",
    )
    env_flag(p, "--preemption", choices=["recompute", "swap"], default="recompute")
    env_flag(
        p,
        "--max-waiting",
        type=count_or_auto,
        default="auto",
        help="waiting requests beyond which new ones get RESOURCE_EXHAUSTED (HTTP 429); auto: "
        "one batch per healthy worker (--max-num-seqs each), so a burst the workers would run "
        "at once is queued, not refused",
    )
    env_flag(
        p,
        "--max-queue-delay",
        type=seconds_or_off,
        default="off",
        help="seconds: a request expected to wait longer than this for its first token behind "
        "the others' work (steps in flight, queued prompts, the running batch's decodes, at "
        "the worker's measured step cost) gets RESOURCE_EXHAUSTED (HTTP 429) at once, so "
        "admitted requests keep their latency under overload; off: no such bound",
    )
    env_flag(p, "--redis-url", default=None, help="Redis for the prefix-hash index")
    env_flag(p, "--no-prefix-caching", action="store_true", help="do not reuse cached KV blocks")
    env_flag(
        p,
        "--no-async-scheduling",
        action="store_true",
        help="plan each step only after the previous one's result (no overlap with the worker)",
    )
    env_flag(
        p,
        "--worker-failover-timeout",
        type=float,
        default=10.0,
        help="seconds a silent worker has before its requests move to another worker",
    )
    env_flag(
        p,
        "--worker-connect-timeout",
        type=float,
        default=300.0,
        help="seconds to wait at startup for the first listed worker to answer before exiting "
        "(0: no limit); the others join whenever they answer",
    )
    env_flag(
        p,
        "--worker-wait-timeout",
        type=float,
        default=30.0,
        help="seconds a request that comes before any worker has registered waits for one "
        "before it is refused with UNAVAILABLE (HTTP 503); 0: refused at once",
    )
    env_flag(
        p,
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        help="seconds a structured-output constraint (JSON schema, regex, grammar) may take to "
        "compile; a slower one is refused (HTTP 400)",
    )
    env_flag(
        p,
        "--chat-template",
        default=None,
        help="the chat template chats are rendered with: a jinja file, or the template itself "
        "(text with braces or a newline), as vLLM's; default: the model's own, or for "
        "SmolLM2-Instruct the shipped control_plane/templates/smollm2-instruct.jinja, which "
        "renders tools",
    )
    env_flag(
        p,
        "--step-trace",
        default=None,
        help="append one JSON line per worker step to this file: its shape (rows, tokens, "
        "attention pairs, context) and timings (what `benchmarks/calibrate_simulator.py` fits)",
    )


def gateway_flags(p: argparse.ArgumentParser) -> None:
    env_flag(
        p,
        "--api-key",
        default=None,
        help="require Authorization: Bearer KEY on /v1/*, /tokenize, /detokenize",
    )
    env_flag(p, "--served-model-name", default=None, help="the model name clients use")
    env_flag(
        p,
        "--max-request-bytes",
        type=parse_bytes,
        default=4 << 20,
        help="largest accepted request body (e.g. 4MiB)",
    )
    env_flag(
        p,
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds a stopping gateway lets in-flight requests finish",
    )
    env_flag(
        p,
        "--http-header-timeout",
        type=float,
        default=10.0,
        help="seconds for a request's headers to arrive (from connecting or the previous "
        "response); a late client is closed (408 if it had started)",
    )
    env_flag(
        p,
        "--http-body-timeout",
        type=float,
        default=30.0,
        help="seconds for a request's body to arrive after its headers (408 beyond)",
    )
    env_flag(
        p,
        "--max-connections",
        type=int,
        default=1000,
        help="open HTTP connections; one more gets 503 + Retry-After and is closed",
    )
    env_flag(
        p,
        "--stream-stall-timeout",
        type=float,
        default=60.0,
        help="seconds a streaming client may read nothing while output waits before its "
        "request is aborted (its KV blocks freed)",
    )
