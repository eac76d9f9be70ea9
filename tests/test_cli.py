"""The command line: `pagedserve up` on the default model, then the README's generate and
stats examples; flags read from the environment; `model init`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.cli.flags import parse_bytes
from pagedserve.cli.main import build_parser
from tests.cpu_hog import busy_machine
from tests.procs import drain, free_port, read_until


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_up_default_model_then_generate_and_stats(tmp_path: Path) -> None:
    cp_port, worker_port = free_port(), free_port()
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedserve.cli",
            "up",
            "--grpc-port",
            str(cp_port),
            "--worker-base-port",
            str(worker_port),
            "--kv-cache-memory",
            "64MiB",
            "--port",
            str(free_port()),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        lines += read_until(proc, "gRPC token saved in", 180)
        assert any("pagedserve is up" in x for x in lines), "".join(lines)[-3000:]
        # Where `generate` and `stats` find the token, under the cache dir `up` had.
        token_file = tmp_path / "cache" / "grpc-tokens" / f"127.0.0.1:{cp_port}"
        assert str(token_file) in lines[-1] and "PAGEDSERVE_CACHE_DIR=" in lines[-1]
        drain(proc, lines)
        # Child output is prefixed with the process name.
        assert any(x.lstrip().startswith("worker-0 |") for x in lines)
        address = f"127.0.0.1:{cp_port}"
        gen = run_cli(
            "generate",
            "--control-plane",
            address,
            "--prompt",
            "Hello",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--json",
            env=env,
        )
        assert gen.returncode == 0, gen.stderr
        msgs = [json.loads(x) for x in gen.stdout.splitlines()]
        assert sum(len(m.get("token_ids", [])) for m in msgs) == 8
        assert msgs[-1]["finish_reason"] == "length"
        text = run_cli(
            "generate", "--control-plane", address, "--prompt", "Hi", "--max-tokens", "4", env=env
        )
        assert text.returncode == 0 and "finish_reason=" in text.stdout
        stats = run_cli("stats", "--control-plane", address, "--json", env=env)
        assert stats.returncode == 0, stats.stderr
        assert int(json.loads(stats.stdout)["num_requests_finished"]) >= 2
        assert (tmp_path / "cache" / "models").is_dir()
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]


def test_generate_reports_unreachable_control_plane() -> None:
    r = run_cli("generate", "--control-plane", f"127.0.0.1:{free_port()}", "--prompt", "x")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr


def test_flags_read_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("PAGEDSERVE_WORKERS", "h:1,h:2")
    monkeypatch.setenv("PAGEDSERVE_PREEMPTION", "swap")
    a = build_parser().parse_args(["control-plane"])
    assert (a.max_num_seqs, a.workers, a.preemption) == (7, "h:1,h:2", "swap")
    a = build_parser().parse_args(["control-plane", "--max-num-seqs", "9"])
    assert a.max_num_seqs == 9


def _parsers(
    parser: argparse.ArgumentParser, name: str = "pagedserve"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_help_shows_defaults_and_env_hints() -> None:
    parsers = dict(_parsers(build_parser()))
    assert {"pagedserve up", "pagedserve gateway", "pagedserve model init"} <= set(parsers)
    assert {"pagedserve bench serve", "pagedserve simulate"} <= set(parsers)
    for name, p in parsers.items():
        text = " ".join(p.format_help().split())
        for action in p._actions:
            default, help_text = action.default, action.help or ""
            if not action.option_strings or "default" in help_text or default == []:
                continue
            if any(default is x for x in (None, False, argparse.SUPPRESS)):
                continue
            if action.nargs == 0:  # a flag: its default is "not given", not shown
                continue
            if isinstance(default, list | tuple):
                default = ",".join(map(str, default))
            assert f"(default: {default})" in text, (name, action.option_strings)
        # A default reads as what one would type: no reprs, no "True" beside a --no-x flag.
        assert "(default: True)" not in text, name
        assert not re.search(r"\(default: [\[(]|\(default: \w+\(", text), name
    gateway = " ".join(parsers["pagedserve gateway"].format_help().split())
    assert "--port PORT [env PAGEDSERVE_PORT] (default: 8000)" in gateway
    assert "(default: 0.0)" in " ".join(parsers["pagedserve generate"].format_help().split())
    bench = " ".join(parsers["pagedserve bench serve"].format_help().split())
    assert "N or LO:HI (default: 32:256)" in bench and "(default: inf)" in bench
    simulate = " ".join(parsers["pagedserve simulate"].format_help().split())
    assert "(default: kv-aware)" in simulate and "(default: 1.0)" in simulate


def test_parse_bytes() -> None:
    assert parse_bytes("4GiB") == 4 << 30
    assert parse_bytes("512M") == 512 << 20
    assert parse_bytes("1000") == 1000


def test_model_init_writes_a_checkpoint(tmp_path: Path) -> None:
    r = run_cli("model", "init", str(tmp_path / "m"), "--arch", "qwen3", "--seed", "3")
    assert r.returncode == 0, r.stderr
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    assert any(n.endswith(".safetensors") for n in names)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"
    ]


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_services_stop_on_sigint_and_sigterm_even_when_sigint_was_ignored(
    micro_llama: Path, stop_signal: signal.Signals
) -> None:
    """A shell starts background jobs with SIGINT ignored; `docker stop` sends SIGTERM."""
    from pagedserve.cli.cluster import grpc_serving

    wport, cport = free_port(), free_port()
    commands = {
        "worker": ["worker", "--model", str(micro_llama), "--port", str(wport)],
        "control-plane": ["control-plane", "--port", str(cport), "--workers", f"127.0.0.1:{wport}"],
    }
    commands["worker"] += ["--kv-cache-memory", "16MiB"]
    # As a shell starts a background job: SIGINT ignored, and exec keeps it ignored. (Not a
    # preexec_fn: Python code between fork and exec in this threaded process can abort.)
    ignore_sigint = ["sh", "-c", 'trap "" INT; exec "$0" "$@"']
    procs = {
        name: subprocess.Popen(
            [*ignore_sigint, sys.executable, "-m", "pagedserve.cli", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, args in commands.items()
    }
    try:
        for name, port in (("worker", wport), ("control-plane", cport)):
            deadline = time.monotonic() + 120
            while not grpc_serving(f"127.0.0.1:{port}") and time.monotonic() < deadline:
                assert procs[name].poll() is None, f"{name} exited early"
                time.sleep(0.2)
        for name in ("control-plane", "worker"):
            procs[name].send_signal(stop_signal)
            # It exits by itself, through its shutdown path (not killed by the signal).
            assert procs[name].wait(timeout=30) >= 0, name
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


# Beside a CPU hog too: the guard's Python start takes what a busy machine gives it, and the
# test waits for what it needs rather than for a time that is enough on a quiet one.
@pytest.mark.parametrize("machine", ["as it is", "busy"])
def test_up_children_die_with_up(machine: str) -> None:
    """`up` starts every child through `pagedserve.child_exec`: killed without a chance to
    clean up, `up` still takes its children with it."""
    with busy_machine() if machine == "busy" else contextlib.nullcontext():
        parent_code = (
            "import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-m', 'pagedserve.child_exec',"
            " str(os.getpid()), 'sleep', '120'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(120)\n"
        )
        parent = subprocess.Popen(
            [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True
        )
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 120  # the guard starts Python first, then exec's `sleep`
        while not _cmdline(child_pid).startswith(b"sleep"):
            assert time.monotonic() < deadline, _cmdline(child_pid)
            time.sleep(0.05)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _alive(child_pid):
            time.sleep(0.1)
        assert not _alive(child_pid)
        # A guard whose parent is already gone refuses to start the program at all.
        orphan = subprocess.run(
            [sys.executable, "-m", "pagedserve.child_exec", "1", "true"], timeout=120
        )
        assert orphan.returncode == 1


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_only_the_worker_loads_torch() -> None:
    """The control plane, the gateway and `up`'s supervisor never run a model: importing torch
    would cost each of them ~1.5 s of CPU at every start and ~200 MiB of memory."""
    code = (
        "import sys, control_plane.server, gateway.server, pagedserve.cli.main, "
        "pagedserve.cli.cluster, pagedserve.cli.model_source, pagedserve.gguf, pagedserve.grammar, "
        "control_plane.tokenizer; "
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors.torch') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
