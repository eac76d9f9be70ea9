"""The subcommands that run a service: `worker`, `control-plane`, `gateway`, and `up` (all of
them as one local cluster)."""

from __future__ import annotations

import argparse
import os
from functools import partial

from pagedserve.cli.startup import (
    chat_template,
    check_port_free,
    config_errors,
    grpc_security,
    resolve_model_dir,
)


def cmd_worker(a: argparse.Namespace) -> int:
    from gpu_worker.affinity import CPU_NICE, bind_threads_to_cores

    bound = bind_threads_to_cores(a.device, a.num_threads, a.tensor_parallel_size)  # before torch
    from gpu_worker.build import WorkerStartupError
    from gpu_worker.checkpoint import CheckpointError
    from gpu_worker.config import WorkerConfig
    from gpu_worker.models.config import UnsupportedModelError
    from gpu_worker.server import serve
    from pagedserve.cli.cluster import stop_on_signals
    from pagedserve.log import configure_logging, get_logger

    configure_logging("worker", a.log_format)
    if bound:
        get_logger("pagedserve.worker").info("threads_bound", places="cores")
    check_port_free(a.host, a.port)
    stop_on_signals()
    with config_errors():
        cfg = WorkerConfig(
            model=resolve_model_dir(a.model, check=False),  # loading it checks it
            host=a.host,
            port=a.port,
            device=a.device,
            dtype=a.dtype,
            kv_cache_dtype=a.kv_cache_dtype,
            block_size=a.block_size,
            kv_cache_memory=a.kv_cache_memory,
            gpu_memory_utilization=a.gpu_memory_utilization,
            swap_space=a.swap_space,
            attention_backend=a.attention_backend,
            served_model_name=a.served_model_name,
            max_model_len=a.max_model_len,
            num_threads=a.num_threads,
            adaptive_threads=bound and not a.no_adaptive_threads,
            tensor_parallel_size=a.tensor_parallel_size,
            warmup_batch_size=a.warmup_batch_size,
            nice=a.nice if a.nice is not None else CPU_NICE if a.device == "cpu" else 0,
            grpc_security=grpc_security(a),
        )
    try:
        serve(cfg)
    except (CheckpointError, UnsupportedModelError, WorkerStartupError) as exc:  # before listening
        raise SystemExit(f"pagedserve: {exc}") from None
    return 0


def cmd_control_plane(a: argparse.Namespace) -> int:
    from control_plane.config import ControlPlaneConfig
    from control_plane.plane import StartupError
    from control_plane.server import serve
    from pagedserve.cli.cluster import run_until_signalled, stop_on_signals
    from pagedserve.log import configure_logging

    configure_logging("control-plane", a.log_format)
    check_port_free(a.host, a.port)
    stop_on_signals()
    with config_errors():
        cfg = ControlPlaneConfig(
            workers=tuple(w.strip() for w in a.workers.split(",") if w.strip()),
            host=a.host,
            port=a.port,
            redis_url=a.redis_url,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            long_prefill_token_threshold=a.long_prefill_token_threshold,
            max_prefill_tokens_with_decodes=a.max_prefill_tokens_with_decodes,
            preemption=a.preemption,
            max_waiting=a.max_waiting,
            max_queue_delay_s=a.max_queue_delay,
            tokenizer=a.tokenizer,
            chat_template=chat_template(a.chat_template),
            served_model_name=a.served_model_name,
            enable_prefix_caching=not a.no_prefix_caching,
            async_scheduling=not a.no_async_scheduling,
            grpc_security=grpc_security(a),
            worker_failover_s=a.worker_failover_timeout,
            worker_connect_timeout_s=a.worker_connect_timeout,
            worker_wait_timeout_s=a.worker_wait_timeout,
            grammar_compile_timeout_s=a.grammar_compile_timeout,
            step_trace=a.step_trace,
            max_request_tokens=a.max_request_tokens,
            max_logprob_entries=a.max_logprob_entries,
        )
    try:
        run_until_signalled(partial(serve, cfg))
    except KeyboardInterrupt:  # before the event loop runs
        pass
    except StartupError as exc:
        raise SystemExit(f"pagedserve control-plane: {exc}") from None
    return 0


def cmd_gateway(a: argparse.Namespace) -> int:
    from gateway.config import GatewayConfig
    from gateway.server import serve

    with config_errors():
        cfg = GatewayConfig(
            control_plane=a.control_plane,
            host=a.host,
            port=a.port,
            api_key=a.api_key or None,
            served_model_name=a.served_model_name or None,
            max_request_bytes=a.max_request_bytes,
            graceful_shutdown_s=a.graceful_shutdown_timeout,
            http_header_timeout_s=a.http_header_timeout,
            http_body_timeout_s=a.http_body_timeout,
            max_connections=a.max_connections,
            max_request_tokens=a.max_request_tokens,
            max_logprob_entries=a.max_logprob_entries,
            stream_stall_timeout_s=a.stream_stall_timeout,
            grpc_security=grpc_security(a, a.control_plane),
        )
    check_port_free(a.host, a.port)
    serve(cfg, log_format=a.log_format)
    return 0


def cmd_up(a: argparse.Namespace) -> int:
    from pagedserve.cli.cluster import StartupError, run_cluster
    from pagedserve.ports import PortError, up_ports

    tls = sorted(k for k in os.environ if k.startswith("PAGEDSERVE_TLS_"))
    if tls:  # the children would read them, and up's health checks speak plaintext
        raise SystemExit(
            f"pagedserve: `up` serves its local ports in plaintext (with a gRPC token); unset "
            f"{', '.join(tls)}, or run the components one by one for TLS"
        )

    # A model that is not there, or that a process would fail on, is the first thing to say.
    model_dir = resolve_model_dir(a.model)
    with config_errors():
        chat_template(a.chat_template)  # checked before anything starts
    try:
        a = up_ports(a)  # every port checked before anything starts
    except PortError as exc:
        raise SystemExit(f"pagedserve: {exc}") from None
    try:
        return run_cluster(a, model_dir)
    except StartupError as exc:  # the child's own lines above say why
        raise SystemExit(f"pagedserve: {exc}") from None
