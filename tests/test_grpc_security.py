"""The internal gRPC services let in only who holds the cluster's token (and, with TLS, trusts
and is trusted by its CA): workers, the control plane, the gateway and `pagedserve up` as real
processes; certificates made here with the openssl command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve import grpc_security
from pagedserve.grpc_security import INSECURE, GrpcSecurity
from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc
from protos.v1 import worker_pb2, worker_pb2_grpc
from tests.gateway_stack import Processes
from tests.procs import ServerProcess, free_port
from tests.stack import Stack, request, start_stack, worker_cli_args

TOKEN = "s3cret-token"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    code: grpc.StatusCode = info.value.code()
    return code


def serving(channel: grpc.Channel) -> bool:
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def fresh_channel(address: str, security: GrpcSecurity = INSECURE) -> grpc.Channel:
    """A channel on its own connection (channels alike share one by default): another client."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    return grpc_security.channel(address, security, options)


def start_worker(
    spawn: Callable[..., ServerProcess],
    model_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    security: GrpcSecurity = INSECURE,
) -> ServerProcess:
    port = free_port()
    argv = worker_cli_args(model_dir, port, 64, 16, "float32")
    address = f"127.0.0.1:{port}"
    return spawn("worker", *argv, *args, ready_address=address, env=env, security=security)


# -- the token ------------------------------------------------------------------------------------


def test_a_worker_refuses_calls_without_the_token(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    worker = start_worker(spawn, micro_llama, env={"PAGEDSERVE_GRPC_TOKEN": TOKEN})
    anonymous = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker.address))
    wrong = worker_pb2_grpc.WorkerStub(
        grpc_security.channel(worker.address, GrpcSecurity(token="not-it"))
    )
    describe = worker_pb2.DescribeRequest()
    with pytest.raises(grpc.RpcError) as info:
        anonymous.Describe(describe, timeout=10)
    assert info.value.code() == UNAUTHENTICATED
    assert "PAGEDSERVE_GRPC_TOKEN" in (info.value.details() or "")
    assert code_of(lambda: wrong.Describe(describe, timeout=10)) == UNAUTHENTICATED
    # The Execute stream is refused when it opens, before any plan is read.
    assert code_of(lambda: list(anonymous.Execute(iter([]), timeout=10))) == UNAUTHENTICATED
    # Health stays open: probes cannot send metadata.
    with grpc.insecure_channel(worker.address) as channel:
        assert serving(channel)

    holder = worker_pb2_grpc.WorkerStub(
        grpc_security.channel(worker.address, GrpcSecurity(token=TOKEN))
    )
    assert holder.Describe(describe, timeout=10).num_gpu_blocks == 64
    assert list(holder.Execute(iter([]), timeout=10)) == []  # opened, and closed by us


@pytest.fixture(scope="module")
def stack(module_spawn: Callable[..., ServerProcess], micro_llama: Path) -> Stack:
    return start_stack(module_spawn, micro_llama, num_gpu_blocks=64, token=TOKEN)


def test_the_control_plane_refuses_calls_without_the_token(stack: Stack) -> None:
    anonymous = pb_grpc.ControlPlaneStub(grpc.insecure_channel(stack.address))
    calls: dict[str, Callable[[], object]] = {
        "Generate": lambda: list(anonymous.Generate(request([5, 6, 7], max_tokens=2), timeout=10)),
        "Stats": lambda: anonymous.Stats(pb.StatsRequest(), timeout=10),
        "Abort": lambda: anonymous.Abort(pb.AbortRequest(request_id="x"), timeout=10),
        "ListModels": lambda: anonymous.ListModels(pb.ListModelsRequest(), timeout=10),
    }
    for name, call in calls.items():
        assert code_of(call) == UNAUTHENTICATED, name
    with grpc.insecure_channel(stack.address) as channel:
        assert serving(channel)

    out = list(stack.stub.Generate(request([5, 6, 7], max_tokens=2, ignore_eos=True), timeout=60))
    assert out[-1].finish_reason == "length"
    assert stack.stats().workers[0].healthy
    assert stack.stub.ListModels(pb.ListModelsRequest(), timeout=10).models


def test_the_cli_clients_send_the_token(stack: Stack) -> None:
    def cli(*args: str, token: str | None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_GRPC_TOKEN"}
        if token is not None:
            env["PAGEDSERVE_GRPC_TOKEN"] = token
        argv = [sys.executable, "-m", "pagedserve.cli", *args, "--control-plane", stack.address]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)

    refused = cli("stats", token=None)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    assert cli("stats", "--json", token=TOKEN).returncode == 0
    out = cli("generate", "--prompt-ids", "5,6,7", "--max-tokens", "2", token=TOKEN)
    assert out.returncode == 0, out.stderr
    assert "completion_tokens=2" in out.stdout


def test_only_the_caller_that_started_a_request_can_abort_it(stack: Stack) -> None:
    other = pb_grpc.ControlPlaneStub(fresh_channel(stack.address, stack.security))
    call = stack.stub.Generate(
        request(list(range(5, 45)), request_id="mine", max_tokens=400, ignore_eos=True),
        timeout=120,
    )
    assert next(call).request_id == "mine"
    # Another client holding the token cannot end it, nor learn that the id is in use.
    assert not other.Abort(pb.AbortRequest(request_id="mine"), timeout=10).found
    assert not other.Abort(pb.AbortRequest(request_id="nobody"), timeout=10).found
    time.sleep(0.2)
    assert stack.stats().num_running == 1
    assert stack.stub.Abort(pb.AbortRequest(request_id="mine"), timeout=10).found
    rest = list(call)
    assert rest[-1].finish_reason == "abort"
    assert sum(len(m.token_ids) for m in rest) < 399


# -- TLS and mTLS ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path  # a leaf for 127.0.0.1 / localhost, good as server and as client certificate
    key: Path
    other_ca: Path  # a CA that signed none of these


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def _make_ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("pki")
    ca, ca_key = _make_ca(d, "cluster-ca")
    other_ca, _ = _make_ca(d, "other-ca")
    (d / "leaf.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "basicConstraints=CA:FALSE\n"
    )
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=pagedserve-node",
        cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "leaf.csr", "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-out", "leaf.pem", "-days", "2", "-extfile", "leaf.ext",
        cwd=d,
    )  # fmt: skip
    return Pki(ca=ca, cert=d / "leaf.pem", key=d / "leaf.key", other_ca=other_ca)


def tls_env(pki: Pki, mtls: bool) -> dict[str, str]:
    env = {"PAGEDSERVE_TLS_CERT_FILE": str(pki.cert), "PAGEDSERVE_TLS_KEY_FILE": str(pki.key)}
    if mtls:
        env["PAGEDSERVE_TLS_CA_FILE"] = str(pki.ca)
    return env


def describe(address: str, security: GrpcSecurity) -> grpc.StatusCode:
    with fresh_channel(address, security) as channel:
        try:
            worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=5)
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            return code
    return grpc.StatusCode.OK


def healthcheck(address: str, *flags: str) -> int:
    argv = [sys.executable, "-m", "pagedserve.cli", "healthcheck", "--grpc", address, *flags]
    return subprocess.run(argv, capture_output=True, timeout=60).returncode


def test_tls_lets_in_only_clients_that_trust_the_ca(
    spawn: Callable[..., ServerProcess], micro_llama: Path, pki: Pki
) -> None:
    client = GrpcSecurity(token=TOKEN, ca_file=str(pki.ca))
    env = {"PAGEDSERVE_GRPC_TOKEN": TOKEN, **tls_env(pki, mtls=False)}
    worker = start_worker(spawn, micro_llama, env=env, security=client)
    assert describe(worker.address, client) == grpc.StatusCode.OK
    # Plaintext, or a CA that did not sign the server's certificate: no connection.
    assert describe(worker.address, GrpcSecurity(token=TOKEN)) == grpc.StatusCode.UNAVAILABLE
    stranger = GrpcSecurity(token=TOKEN, ca_file=str(pki.other_ca))
    assert describe(worker.address, stranger) == grpc.StatusCode.UNAVAILABLE
    # TLS does not stand in for the token.
    assert describe(worker.address, GrpcSecurity(ca_file=str(pki.ca))) == UNAUTHENTICATED
    assert healthcheck(worker.address, "--tls-ca-file", str(pki.ca)) == 0
    assert healthcheck(worker.address) == 1


def test_mtls_refuses_clients_without_a_certificate(
    spawn: Callable[..., ServerProcess], micro_llama: Path, pki: Pki
) -> None:
    client = GrpcSecurity(
        token=TOKEN, cert_file=str(pki.cert), key_file=str(pki.key), ca_file=str(pki.ca)
    )
    env = {"PAGEDSERVE_GRPC_TOKEN": TOKEN, **tls_env(pki, mtls=True)}
    worker = start_worker(spawn, micro_llama, env=env, security=client)
    assert describe(worker.address, client) == grpc.StatusCode.OK
    no_cert = GrpcSecurity(token=TOKEN, ca_file=str(pki.ca))
    assert describe(worker.address, no_cert) == grpc.StatusCode.UNAVAILABLE
    flags = ("--tls-ca-file", str(pki.ca))
    assert healthcheck(worker.address, *flags) == 1
    assert healthcheck(worker.address, *flags, "--tls-cert-file", str(pki.cert),
                       "--tls-key-file", str(pki.key)) == 0  # fmt: skip


# -- the whole stack ------------------------------------------------------------------------------


@pytest.fixture
def processes() -> Iterator[Processes]:
    procs = Processes()
    yield procs
    procs.stop_all()


def test_the_gateway_serves_through_an_mtls_cluster_with_a_token(
    processes: Processes, micro_llama: Path, pki: Pki
) -> None:
    """Gateway -> control plane -> worker, every hop on mTLS with the token."""
    env = {"PAGEDSERVE_GRPC_TOKEN": TOKEN, **tls_env(pki, mtls=True)}
    client = GrpcSecurity(
        token=TOKEN, cert_file=str(pki.cert), key_file=str(pki.key), ca_file=str(pki.ca)
    )
    worker = start_worker(processes.spawn, micro_llama, env=env, security=client)
    port = free_port()
    cp = processes.spawn(
        "control-plane", "control-plane", "--port", str(port), "--workers", worker.address,
        ready_address=f"127.0.0.1:{port}", env=env, security=client,
    )  # fmt: skip
    gateway = processes.gateway(cp.address, env=env)
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200
    # The control plane's port, reached without a certificate, answers nothing.
    without_cert = GrpcSecurity(token=TOKEN, ca_file=str(pki.ca))
    with fresh_channel(cp.address, without_cert) as channel:
        stub = pb_grpc.ControlPlaneStub(channel)
        assert code_of(lambda: stub.Stats(pb.StatsRequest(), timeout=5)) == (
            grpc.StatusCode.UNAVAILABLE
        )


def test_up_refuses_tls_settings_it_would_not_apply(tmp_path: Path) -> None:
    env = {**os.environ, "PAGEDSERVE_TLS_CA_FILE": str(tmp_path / "ca.pem")}
    argv = [sys.executable, "-m", "pagedserve.cli", "up", "--model", str(tmp_path)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode != 0 and "PAGEDSERVE_TLS_CA_FILE" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_token_stays_out_of_reprs() -> None:
    assert TOKEN not in repr(GrpcSecurity(token=TOKEN))


@pytest.mark.parametrize("given", [None, "a-given-token"])
def test_up_protects_its_ports_with_a_token(
    micro_llama: Path, tmp_path: Path, given: str | None
) -> None:
    """A fresh random token unless one is given; `pagedserve stats` finds it."""
    http_port, grpc_port, worker_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env |= {"OMP_NUM_THREADS": "1", "PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    if given is not None:
        env["PAGEDSERVE_GRPC_TOKEN"] = given
    argv = [
        sys.executable, "-m", "pagedserve.cli", "up", "--model", str(micro_llama),
        "--port", str(http_port), "--grpc-port", str(grpc_port),
        "--worker-base-port", str(worker_port), "--kv-cache-memory", "16MiB",
        "--redis-url", "",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "pagedserve is up" in line:
                break
        assert "pagedserve is up" in lines[-1], "".join(lines)[-3000:]
        cp_address, worker_address = f"127.0.0.1:{grpc_port}", f"127.0.0.1:{worker_port}"

        token_file = tmp_path / "grpc-tokens" / cp_address
        token = token_file.read_text()
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        assert token == given if given is not None else len(token) >= 32

        anonymous = pb_grpc.ControlPlaneStub(fresh_channel(cp_address))
        assert code_of(lambda: anonymous.Stats(pb.StatsRequest(), timeout=10)) == UNAUTHENTICATED
        assert describe(worker_address, INSECURE) == UNAUTHENTICATED
        assert describe(worker_address, GrpcSecurity(token=token)) == grpc.StatusCode.OK

        body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        # `pagedserve stats` with no token given uses the one up saved; a given one wins.
        stats_argv = [sys.executable, "-m", "pagedserve.cli", "stats", "--control-plane"]
        client_env = {k: v for k, v in env.items() if k != "PAGEDSERVE_GRPC_TOKEN"}
        for token_given, rc in ((None, 0), ("not-the-token", 1)):
            if token_given is not None:
                client_env["PAGEDSERVE_GRPC_TOKEN"] = token_given
            out = subprocess.run(
                [*stats_argv, cp_address], capture_output=True, text=True, env=client_env,
                timeout=60,
            )  # fmt: skip
            assert out.returncode == rc, out.stderr
        assert "UNAUTHENTICATED" in out.stderr
        # The token reaches the children by their environment, never their argv.
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert "pagedserve.cli worker" in ps and token not in ps
    finally:
        proc.send_signal(2)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
