"""The `pagedserve` command line. Every flag also reads PAGEDSERVE_<FLAG> from the environment
(e.g. --max-num-seqs <- PAGEDSERVE_MAX_NUM_SEQS); an explicit flag wins."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence
from typing import Any

from pagedserve.cli.flags import (
    MODEL_HELP,
    budget_flags,
    client_flags,
    env_flag,
    grpc_security_flags,
    log_format_flag,
)
from pagedserve.cli.serve_commands import cmd_control_plane, cmd_gateway, cmd_up, cmd_worker
from pagedserve.cli.service_flags import gateway_flags, scheduler_flags, worker_flags
from pagedserve.cli.tool_commands import (
    cmd_generate,
    cmd_healthcheck,
    cmd_model_convert,
    cmd_model_init,
    cmd_stats,
)


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
    env_flag(w, "--model", default=None, help=MODEL_HELP)
    env_flag(w, "--host", default="127.0.0.1")
    env_flag(w, "--port", type=int, default=50061)
    env_flag(w, "--served-model-name", default=None)
    worker_flags(w)
    grpc_security_flags(w)
    log_format_flag(w)
    w.set_defaults(func=cmd_worker)

    cp = sub.add_parser("control-plane", help="run the control plane")
    env_flag(cp, "--host", default="127.0.0.1")
    env_flag(cp, "--port", type=int, default=50051)
    env_flag(cp, "--workers", required=True, help="HOST:PORT[,HOST:PORT...]")
    env_flag(cp, "--tokenizer", default=None, help="tokenizer dir (default: the worker's model)")
    env_flag(cp, "--served-model-name", default=None)
    scheduler_flags(cp)
    budget_flags(cp)
    grpc_security_flags(cp)
    log_format_flag(cp)
    cp.set_defaults(func=cmd_control_plane)

    gw = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    env_flag(gw, "--host", default="127.0.0.1")
    env_flag(gw, "--port", type=int, default=8000)
    env_flag(gw, "--control-plane", default="127.0.0.1:50051", help="HOST:PORT")
    gateway_flags(gw)
    budget_flags(gw)
    grpc_security_flags(gw)
    log_format_flag(gw)
    gw.set_defaults(func=cmd_gateway)

    up = sub.add_parser(
        "up", help="run a local cluster: redis, workers, control plane and the HTTP gateway"
    )
    env_flag(up, "--model", default=None, help=MODEL_HELP)
    env_flag(up, "--workers", type=int, default=1, help="number of worker processes")
    env_flag(
        up,
        "--devices",
        default=None,
        help="with --device cuda: the GPUs the workers run on, --tensor-parallel-size of them "
        "each, in order (e.g. 0,1,2,3); default: those CUDA_VISIBLE_DEVICES shows, else 0,1,...",
    )
    env_flag(up, "--host", default="127.0.0.1")
    env_flag(
        up,
        "--port",
        type=int,
        default=None,
        help="gateway HTTP port (default: 8000, or a free port when 8000 is taken)",
    )
    env_flag(
        up,
        "--grpc-port",
        type=int,
        default=None,
        help="control plane port (default: 50051, or a free port when 50051 is taken)",
    )
    env_flag(
        up,
        "--worker-base-port",
        type=int,
        default=None,
        help="port of the first worker, the others follow it (default: 50061, or free ports "
        "when those are taken)",
    )
    env_flag(
        up,
        "--redis-port",
        type=int,
        default=0,
        help="port of the redis-server started when --redis-url is not given (0: a free one)",
    )
    worker_flags(up)
    scheduler_flags(up)
    gateway_flags(up)
    budget_flags(up)
    # A fresh random token by default; no TLS flags: `up` serves its local ports in plaintext.
    grpc_security_flags(up, tls=False)
    log_format_flag(up)
    up.set_defaults(func=cmd_up)

    hc = sub.add_parser("healthcheck", help="exit 0 when a server is healthy (for probes)")
    target = hc.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="HOST:PORT", help="grpc.health.v1 reports SERVING")
    target.add_argument("--http", metavar="URL", help="GET URL answers 2xx")
    hc.add_argument("--timeout", type=float, default=3.0, help="seconds")
    grpc_security_flags(hc)  # health needs no token, but TLS / mTLS apply
    hc.set_defaults(func=cmd_healthcheck)

    gen = sub.add_parser("generate", help="generate from a prompt through the control plane")
    client_flags(gen)
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
    client_flags(st)
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
