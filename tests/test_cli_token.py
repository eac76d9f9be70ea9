"""`pagedserve generate` / `stats` against a control plane that refuses them: the error says where
the CLI looked for the gRPC token `pagedserve up` saved, or where the token it sent came from."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import pytest

from pagedserve import envs, grpc_security
from pagedserve.grpc_security import GrpcSecurity, save_token, saved_token_line, token_path
from protos.v1 import control_plane_pb2_grpc as pb_grpc
from tests.procs import free_port

TOKEN = "the-cluster-token"


@pytest.fixture
def guarded_address() -> Iterator[str]:
    """A control plane's address whose gRPC server requires TOKEN (its methods never run: the
    token check refuses first)."""
    server = grpc_security.server(GrpcSecurity(token=TOKEN), futures.ThreadPoolExecutor(2), [])
    pb_grpc.add_ControlPlaneServicer_to_server(pb_grpc.ControlPlaneServicer(), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )


@pytest.mark.parametrize("command", [["stats"], ["generate", "--prompt", "hi"]])
def test_a_missing_token_says_where_it_was_looked_for(
    guarded_address: str, tmp_path: Path, command: list[str]
) -> None:
    """`up` ran with PAGEDSERVE_CACHE_DIR, this client without: it looked in ~/.cache."""
    home = tmp_path / "home"
    env = {"HOME": str(home)}
    out = run_cli(*command, "--control-plane", guarded_address, env=env)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert "UNAUTHENTICATED" in lines[0] and "Traceback" not in out.stderr
    looked = home / ".cache" / "pagedserve" / "grpc-tokens" / guarded_address
    assert len(lines) == 2 and str(looked) in lines[1], out.stderr
    assert "PAGEDSERVE_CACHE_DIR" in lines[1]


def test_the_saved_token_is_found_under_the_same_cache_dir(
    guarded_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    envs.reload()
    path = save_token(guarded_address, TOKEN)
    assert path == token_path(guarded_address) == tmp_path / "grpc-tokens" / guarded_address
    # What `up` prints beside its URL names the file and the setting a client needs.
    line = saved_token_line(path)
    assert str(path) in line and f"PAGEDSERVE_CACHE_DIR={tmp_path}" in line
    env = {"PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    ok = run_cli("stats", "--control-plane", guarded_address, env=env)
    assert "UNAUTHENTICATED" not in ok.stderr  # let in; the servicer itself is not implemented


def test_a_stale_saved_token_says_where_it_came_from(guarded_address: str, tmp_path: Path) -> None:
    env = {"PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    path = tmp_path / "grpc-tokens" / guarded_address
    path.parent.mkdir(parents=True)
    path.write_text("an-old-runs-token")
    out = run_cli("stats", "--control-plane", guarded_address, env=env)
    assert out.returncode == 1 and "the gRPC token is wrong" in out.stderr
    assert f"saved in {path}" in out.stderr.strip().splitlines()[-1]
