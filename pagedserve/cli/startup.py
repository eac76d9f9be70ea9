"""What the subcommands resolve before they start: the model, the gRPC security, the chat
template, the port. A problem with any of them exits with one line, no traceback."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def resolve_model_dir(arg: str | None, check: bool = True) -> str:
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


def grpc_security(a: argparse.Namespace, control_plane: str | None = None) -> Any:
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


def token_source(a: argparse.Namespace, control_plane: str) -> str:
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
def config_errors() -> Iterator[None]:
    """A configuration the flags describe that cannot run: one line, no traceback."""
    try:
        yield
    except ValueError as exc:
        raise SystemExit(f"pagedserve: {exc}") from None


def chat_template(value: str | None) -> str | None:
    """The template --chat-template names (ValueError if none), or None without the flag."""
    from control_plane.chat_templates import load_chat_template

    return load_chat_template(value) if value else None


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Exits with one line when the port this server is about to listen on is taken."""
    from pagedserve.ports import PortError, check_port

    try:
        check_port(host, port, flag)
    except PortError as exc:
        raise SystemExit(f"pagedserve: {exc}") from None
