"""What a user reads when something is wrong, and at startup: one line on stderr and a non-zero
exit for a model path that does not exist, a busy port, a server that is not there or refuses
the API key; `--log-format`; the worker's startup lines; `up`'s curl hint with an API key."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpu_worker.attention import cpu_prefill
from pagedserve import envs, ports
from pagedserve.cli.cluster import try_curl
from pagedserve.ports import PortError, PortRequest, choose_ports, up_ports
from tests.gateway_stack import HttpProcess
from tests.procs import ServerProcess, free_port, read_until


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,  # a hang: a busy machine takes minutes to import what some commands need
        env={**clean, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    """The single line a failed command printed on stderr (no traceback)."""
    assert out.returncode != 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something listens on, with SO_REUSEPORT as a gRPC server's socket has it: a
    second gRPC server would bind it too, and share its connections."""
    with _listening(0) as s:
        yield int(s.getsockname()[1])


def _listening(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


# -- a model that is not there ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["up", "worker"])
def test_a_model_path_that_does_not_exist(command: str) -> None:
    line = one_line_error(run_cli(command, "--model", "/no/such/path"))
    assert line == (
        "pagedserve: --model /no/such/path does not exist (and is not a preset: tiny, small)"
    )


def _copy_checkpoint(src: Path, dst: Path, leave_out: str = "") -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != leave_out:
            shutil.copyfile(f, dst / f.name)
    return dst


def test_up_with_a_checkpoint_whose_worker_fails(tmp_path: Path, micro_llama: Path) -> None:
    """`up` whose worker exits while starting says which child, after the child's own line:
    here a tensor missing from the weights, which only the worker, building the model, sees."""
    from safetensors.torch import load_file, save_file

    ckpt = _copy_checkpoint(micro_llama, tmp_path / "m")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    ps = [str(free_port()) for _ in range(3)]
    argv = ["up", "--model", str(ckpt), "--port", ps[0], "--grpc-port", ps[1]]
    out = run_cli(*argv, "--worker-base-port", ps[2], "--log-format", "json")
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "pagedserve: worker-0 exited with code 1"
    assert "is missing 1 tensor(s): model.norm.weight" in out.stdout


@pytest.mark.parametrize(
    ("leave_out", "config", "said"),
    [
        ("tokenizer.json", None, "has no tokenizer.json, which the control plane needs"),
        ("", '{"model_type": "llama", "hidden_size": 64}', "config.json lacks required keys"),
    ],
)
def test_up_checks_the_whole_checkpoint_before_starting(
    tmp_path: Path, micro_llama: Path, leave_out: str, config: str | None, said: str
) -> None:
    """What the control plane or a worker would fail on once started is one line at once: no
    process starts (no worker line, no redis), no traceback."""
    ckpt = _copy_checkpoint(micro_llama, tmp_path / "m", leave_out)
    if config is not None:
        (ckpt / "config.json").write_text(config)
    out = run_cli("up", "--model", str(ckpt), "--port", str(free_port()))
    line = one_line_error(out)
    assert line.startswith(f"pagedserve: {ckpt}") and said in line, line
    assert out.stdout == ""


def test_a_control_plane_whose_worker_has_no_tokenizer(
    tmp_path: Path, micro_llama: Path, spawn: Callable[..., ServerProcess]
) -> None:
    """Started alone (not through `up`, which checks first), the control plane ends with one
    line naming the missing file once the worker registers, not a traceback."""
    model = tmp_path / "model"
    shutil.copytree(micro_llama, model)
    (model / "tokenizer.json").unlink()
    wport = free_port()
    worker = spawn(
        "worker", "worker", "--model", str(model), "--port", str(wport),
        "--kv-cache-memory", str(1 << 20), ready_address=f"127.0.0.1:{wport}",
    )  # fmt: skip
    out = run_cli("control-plane", "--port", str(free_port()), "--workers", worker.address)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    line = out.stderr.strip().splitlines()[-1]  # after its JSON log lines
    assert line.startswith("pagedserve control-plane: cannot serve the model of worker"), line
    assert "tokenizer.json" in line and worker.address in line, line


def test_up_with_a_hub_id() -> None:
    line = one_line_error(run_cli("up", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert "does not reach model hubs" in line and "--model DIR" in line


# -- busy ports ---------------------------------------------------------------------------------


def _free_pair() -> int:
    """A free port whose successor is free too."""
    while True:
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p


@pytest.mark.parametrize("flag", ["--port", "--grpc-port", "--worker-base-port", "--redis-port"])
def test_up_names_the_flag_of_a_busy_port(micro_llama: Path, busy_port: int, flag: str) -> None:
    """Every port is checked before anything starts: nothing is left to stop, at once."""
    given = {f: str(free_port()) for f in ("--port", "--grpc-port")}
    given["--worker-base-port"] = str(_free_pair())  # two workers: the port and the next one
    given["--redis-port"] = str(free_port())
    with contextlib.ExitStack() as held:
        if flag == "--worker-base-port":  # the second worker's port is the busy one
            base = _free_pair()
            busy_port = held.enter_context(_listening(base + 1)).getsockname()[1]
            given[flag] = str(base)
        else:
            given[flag] = str(busy_port)
        args = [x for kv in given.items() for x in kv]
        out = run_cli("up", "--model", str(micro_llama), "--workers", "2", *args)
    assert one_line_error(out) == (
        f"pagedserve: port {busy_port} is in use; choose another with {flag}"
    )
    assert out.stdout == ""  # no child was started: each logs on up's stdout from its start


def test_up_refuses_overlapping_ports(micro_llama: Path) -> None:
    p = str(free_port())
    out = run_cli("up", "--model", str(micro_llama), "--grpc-port", p, "--worker-base-port", p)
    assert "overlaps the ports of" in one_line_error(out)


@pytest.mark.parametrize(
    "command",
    [
        ["worker", "--model", "MODEL"],
        ["control-plane", "--workers", "127.0.0.1:1"],
        ["gateway"],
    ],
)
def test_a_component_on_a_busy_port(micro_llama: Path, busy_port: int, command: list[str]) -> None:
    argv = [str(micro_llama) if a == "MODEL" else a for a in command]
    out = run_cli(*argv, "--port", str(busy_port))
    assert one_line_error(out) == (
        f"pagedserve: port {busy_port} is in use; choose another with --port"
    )


def test_busy_defaults_move_to_free_ports(
    busy_port: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A port left at its default that is taken is replaced, and said so; a given one is not."""
    for name in ("DEFAULT_HTTP_PORT", "DEFAULT_GRPC_PORT", "DEFAULT_WORKER_BASE_PORT"):
        monkeypatch.setattr(ports, name, busy_port)
    a = argparse.Namespace(
        host="127.0.0.1",
        port=None,
        grpc_port=None,
        worker_base_port=None,
        workers=3,
        redis_url=None,
        redis_port=0,
    )
    out = up_ports(a)
    chosen = [out.port, out.grpc_port, *range(out.worker_base_port, out.worker_base_port + 3)]
    chosen.append(out.redis_port)
    assert busy_port not in chosen and len(set(chosen)) == len(chosen)
    assert a.port is None  # the caller's arguments are left as they were
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"port {busy_port} is taken: the gateway uses {out.port}",
        f"port {busy_port} is taken: the control plane uses {out.grpc_port}",
        f"port {busy_port}-{busy_port + 2} is taken: the workers use ports from "
        f"{out.worker_base_port}",
    ]
    free = free_port()
    got, notes = choose_ports("127.0.0.1", [PortRequest("x", "--x", None, free)])
    assert got == [free] and notes == []
    with pytest.raises(PortError, match=f"port {busy_port} is in use; choose another with --x"):
        choose_ports("127.0.0.1", [PortRequest("x", "--x", busy_port, 1)])


# -- bench serve --------------------------------------------------------------------------------


def test_bench_serve_with_no_server() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    line = one_line_error(run_cli("bench", "serve", "--base-url", url, "--num-prompts", "1"))
    assert line.startswith(f"pagedserve bench serve: no server answers at {url}")


def test_bench_serve_without_the_api_key(tmp_path: Path) -> None:
    """A gateway alone (no control plane needed: the key is checked first)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["gateway", "--port", str(port), "--control-plane", f"127.0.0.1:{free_port()}"]
    gateway = HttpProcess("gateway", argv, url, env={"PAGEDSERVE_API_KEY": "right"})
    try:
        gateway.wait_ready()
        bench = ("bench", "serve", "--base-url", url, "--num-prompts", "1")
        assert one_line_error(run_cli(*bench)) == (
            f"pagedserve bench serve: {url} requires an API key (HTTP 401): pass --api-key or "
            "set PAGEDSERVE_API_KEY"
        )
        assert one_line_error(run_cli(*bench, "--api-key", "wrong")) == (
            f"pagedserve bench serve: {url} refused the API key (HTTP 401)"
        )
        # The key from the environment gets past the check (to the missing control plane).
        line = one_line_error(run_cli(*bench, env={"PAGEDSERVE_API_KEY": "right"}))
        assert "HTTP 503" in line and "API key" not in line
    finally:
        gateway.stop()


# -- startup lines and --log-format -------------------------------------------------------------


def _events(text: str) -> dict[str, dict[str, object]]:
    out = {}
    for line in text.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            out.setdefault(str(record["event"]), record)
    return out


def test_worker_startup_lines(
    micro_llama: Path, spawn: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """The model (path, size, dtype), the CPU kernels (compiled, then found in the cache),
    both KV pools in blocks, tokens and bytes, and the heap frozen once ready; JSON by default
    off a terminal, key=value lines with --log-format console."""
    env = {"PAGEDSERVE_CACHE_DIR": str(tmp_path), "PAGEDSERVE_LOG_FORMAT": "auto"}
    args = ["--model", str(micro_llama), "--dtype", "float32", "--block-size", "16"]
    args += ["--kv-cache-memory", "1MiB", "--swap-space", "2MiB"]
    port = free_port()
    first = spawn(
        "worker", "worker", *args, "--port", str(port), ready_address=f"127.0.0.1:{port}", env=env
    )
    ev = _events(first.output())
    loading = ev["model_loading"]
    assert loading["path"] == str(micro_llama.resolve()) and loading["dtype"] == "float32"
    assert str(loading["size"]).endswith(" MiB") or str(loading["size"]).endswith(" KiB")
    assert "seconds" in ev["model_loaded"]
    compiled = [
        json.loads(line)
        for line in first.output().splitlines()
        if line.startswith("{") and '"cpu_kernel_compiled"' in line
    ]
    # float32 on a CPU: the decode kernel, the fused elementwise ops and, where this CPU runs
    # prompts through it rather than SDPA, the prefill kernel.
    sources = ["fused_ops_cpu.c", "paged_decode_cpu.c"]
    sources += ["prefill_attention_cpu.c"] if cpu_prefill.preferred() else []
    assert sorted(c["source"] for c in compiled) == sources
    assert all(float(c["seconds"]) > 0 for c in compiled)
    # micro: 2 layers, 2 KV heads of 16 dims; a float32 block of 16 tokens holds K and V:
    # 2 x 2 x 16 x 2 x 16 x 4 bytes = 8 KiB.
    kv, swap = ev["kv_cache_allocated"], ev["swap_pool_allocated"]
    assert (kv["blocks"], kv["tokens"], kv["size"]) == (128, 2048, "1.0 MiB")
    assert (swap["blocks"], swap["tokens"], swap["size"]) == (256, 4096, "2.0 MiB")
    # What start-up made (modules, the model) is out of the collector's way once ready.
    assert int(ev["worker_ready"]["frozen_objects"]) > 10_000

    port = free_port()
    console = ["--log-format", "console", "--port", str(port)]
    again = spawn("worker", "worker", *args, *console, ready_address=f"127.0.0.1:{port}", env=env)
    text = again.output()
    assert not any(line.startswith("{") for line in text.splitlines()), text[-2000:]
    assert "\x1b[" not in text  # no colour codes off a terminal
    cached = [x for x in text.splitlines() if "cpu_kernel_cached" in x]
    for source in sources:
        assert sum(f"source={source}" in x for x in cached) == 1
    kv_line = next(x for x in text.splitlines() if "kv_cache_allocated" in x)
    assert "blocks=128" in kv_line and "tokens=2048" in kv_line and "size='1.0 MiB'" in kv_line


def test_try_curl_never_prints_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    envs.reload()
    url = "http://127.0.0.1:8000"
    assert "Authorization" not in "".join(try_curl(url, None))
    given = try_curl(url, "s3cret")
    assert not any("s3cret" in line for line in given)
    assert given[0].startswith("export PAGEDSERVE_API_KEY=")
    assert '-H "Authorization: Bearer $PAGEDSERVE_API_KEY"' in given[1]
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "s3cret")
    envs.reload()
    (line,) = try_curl(url, "s3cret")
    assert line.startswith("try: curl ") and "$PAGEDSERVE_API_KEY" in line and "s3cret" not in line


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_up_with_console_logs_and_an_api_key(micro_llama: Path) -> None:
    """`up --log-format console` shows its children's lines as key=value; with the key in the
    environment, the curl hint runs as printed."""
    http_port, grpc_port, worker_port = free_port(), free_port(), free_port()
    argv = [
        sys.executable, "-m", "pagedserve.cli", "up", "--model", str(micro_llama),
        "--port", str(http_port), "--grpc-port", str(grpc_port),
        "--worker-base-port", str(worker_port), "--kv-cache-memory", "4MiB",
        "--swap-space", "0", "--log-format", "console",
    ]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env = {**clean, "OMP_NUM_THREADS": "1", "PAGEDSERVE_API_KEY": "k3y"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        lines += read_until(proc, "try: curl", 120)
        text = "".join(lines)
        assert lines and lines[-1].startswith("try: curl"), text[-3000:]
        worker = [x for x in lines if x.lstrip().startswith("worker-0 |")]
        assert any("worker_listening" in x and "address=" in x for x in worker), text[-3000:]
        assert not any(x.split("| ", 1)[1].startswith("{") for x in worker)
        hint = lines[-1]
        assert '-H "Authorization: Bearer $PAGEDSERVE_API_KEY"' in hint and "k3y" not in text
        curl = hint.removeprefix("try: ").replace("-d '", "-s -d '")
        out = subprocess.run(
            ["bash", "-c", curl], capture_output=True, text=True, timeout=60, env=env
        )
        assert json.loads(out.stdout)["object"] == "chat.completion", out.stdout + out.stderr
    finally:
        proc.terminate()
        proc.wait(60)
