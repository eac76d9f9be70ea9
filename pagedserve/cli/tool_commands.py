"""The subcommands that do one thing and exit: `model init`, `model convert`, `healthcheck`, and
the control-plane clients `generate` and `stats`."""

from __future__ import annotations

import argparse

from pagedserve.cli.startup import grpc_security, token_source


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


def cmd_healthcheck(a: argparse.Namespace) -> int:
    from pagedserve.cli.cluster import grpc_serving, http_ok

    if a.grpc:
        ok = grpc_serving(a.grpc, a.timeout, grpc_security(a))
    else:
        ok = http_ok(a.http, a.timeout)
    return 0 if ok else 1


def cmd_generate(a: argparse.Namespace) -> int:
    from pagedserve.cli.client import generate_main

    return generate_main(a, grpc_security(a, a.control_plane), token_source(a, a.control_plane))


def cmd_stats(a: argparse.Namespace) -> int:
    from pagedserve.cli.client import stats_main

    return stats_main(a, grpc_security(a, a.control_plane), token_source(a, a.control_plane))
