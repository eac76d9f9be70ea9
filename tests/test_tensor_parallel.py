"""Tensor parallelism inside a worker (gloo on CPU): a TP group's greedy output equals
transformers' token for token in float64, under chunked prefill, preemption, prefix caching
and n > 1; a rank that dies takes its group down and the requests move; an impossible split
is refused at start."""

from __future__ import annotations

import ipaddress
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pagedserve.cli.model_source import ensure_default_model, smollm2_gguf
from tests.conftest import MICRO
from tests.oracle import hf_greedy
from tests.procs import ServerProcess
from tests.stack import Stack, generate, greedy_to_length, start_stack

TP = ("--tensor-parallel-size", "2")


def _prompts(seed: int, count: int, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _run_all(stack: Stack, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: greedy_to_length(stack.stub, p, max_tokens), prompts))


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", MICRO),  # GQA: 4 query heads, 2 KV heads
        ("qwen2", {**MICRO, "tie_word_embeddings": True}),  # qkv bias, tied embeddings
        ("llama", {**MICRO, "num_key_value_heads": 1}),  # one KV head, replicated on both ranks
    ],
    ids=["llama-gqa", "qwen2-bias-tied", "llama-kv-replicated"],
)
def test_tp2_greedy_equals_transformers(
    arch: str,
    overrides: dict[str, Any],
    make_checkpoint: Callable[..., Path],
    spawn: Callable[..., ServerProcess],
) -> None:
    ckpt = make_checkpoint(arch, **overrides)
    prompts = _prompts(1, 6)
    expected = hf_greedy(ckpt, prompts, [24] * len(prompts))
    stack = start_stack(spawn, ckpt, dtype="float64", worker_args=TP)
    assert _run_all(stack, prompts, 24) == expected
    info = stack.stats().workers[0]
    assert info.healthy


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_tp2_under_pressure(
    preemption: str, micro_llama: Path, spawn: Callable[..., ServerProcess]
) -> None:
    """Chunked prefill (16-token chunks), forced preemption (24 blocks), prefix caching (every
    prompt shares a 32-token head) and n = 3 (every child greedy)."""
    head = _prompts(2, 1, 32, 32)[0]
    prompts = [head + p for p in _prompts(3, 6, 10, 40)]
    expected = hf_greedy(micro_llama, prompts, [40] * len(prompts))
    stack = start_stack(
        spawn,
        micro_llama,
        dtype="float64",
        num_gpu_blocks=24,
        worker_args=TP,
        cp_args=(
            "--max-num-batched-tokens",
            "16",
            "--preemption",
            preemption,
            "--max-waiting",
            "64",
        ),  # fmt: skip
    )
    assert _run_all(stack, prompts, 40) == expected
    out = generate(stack.stub, prompts[0], max_tokens=40, temperature=0.0, ignore_eos=True, n=3)
    by_index: dict[int, list[int]] = {}
    for c in out.chunks:
        by_index.setdefault(c.index, []).extend(c.token_ids)
    assert [by_index[i] for i in range(3)] == [expected[0]] * 3
    w = stack.stats().workers[0]
    assert w.num_preemptions > 0 and w.num_chunked_prefill_steps > 0
    assert w.prefix_cache_hits > 0


def test_smollm2_tp3_equals_tp1(spawn: Callable[..., ServerProcess]) -> None:
    """SmolLM2's 9 heads and 3 KV heads split over 3 ranks."""
    model = ensure_default_model()  # safetensors: each rank reads only its slices
    prompts = _prompts(4, 3, 10, 30)
    one = start_stack(spawn, model, dtype="float64", num_gpu_blocks=128)
    expected = _run_all(one, prompts, 16)
    three = start_stack(
        spawn,
        model,
        dtype="float64",
        num_gpu_blocks=128,
        worker_args=("--tensor-parallel-size", "3"),
    )
    assert _run_all(three, prompts, 16) == expected


def test_an_impossible_split_is_refused(port: int) -> None:
    """SmolLM2's 9 attention heads do not split over 2 ranks: one line, a non-zero exit, and
    no rank left running."""
    cmd = [
        sys.executable, "-m", "pagedserve.cli", "worker", "--model", str(smollm2_gguf()),
        "--port", str(port), "--tensor-parallel-size", "2",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "9 attention heads do not split over tensor-parallel size 2" in stderr
    # Ranks 1.. would run under `pagedserve.child_exec <rank 0's pid>`.
    leftover = subprocess.run(
        ["pgrep", "-f", f"child_exec {proc.pid} .*gpu_worker.follower"],
        capture_output=True,
        text=True,
    ).stdout
    assert not leftover.strip()


def test_a_dead_rank_takes_its_group_down_and_requests_move(
    micro_llama: Path, spawn: Callable[..., ServerProcess]
) -> None:
    prompts = _prompts(5, 6, 20, 60)
    max_tokens = 120
    expected = hf_greedy(micro_llama, prompts, [max_tokens] * len(prompts))
    stack = start_stack(
        spawn,
        micro_llama,
        dtype="float64",
        num_workers=2,
        worker_args=TP,
        cp_args=("--worker-failover-timeout", "1"),
    )
    group = stack.workers[1]
    ranks = subprocess.run(
        ["pgrep", "-P", str(group.proc.pid), "-f", "gpu_worker.follower"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(ranks) == 1, ranks
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(greedy_to_length, stack.stub, p, max_tokens) for p in prompts]
        deadline = time.monotonic() + 60
        while min(w.num_generated_tokens for w in stack.stats().workers) < 20:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        subprocess.run(["kill", "-9", ranks[0]], check=True)
        outs = [f.result(timeout=180) for f in futures]
    assert outs == expected
    group.proc.wait(timeout=30)  # rank 0 left with its rank 1
    assert group.proc.returncode != 0


def _listening(pids: set[int]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The local address of every TCP socket that one of `pids` holds in LISTEN state."""
    inodes: set[str] = set()
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        for fd in fds.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(local.split(":")[0])
            # The kernel prints each 32-bit word of the address in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(ipaddress.ip_address(words))
    return found


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc")
def test_a_tp_group_listens_on_loopback_only(
    micro_llama: Path, spawn: Callable[..., ServerProcess]
) -> None:
    """Rank 0's torch.distributed store and the ranks' collective sockets take connections
    from anyone who reaches them, unauthenticated: they must not listen beyond loopback (the
    ranks all run on this host), as the worker itself does not (it binds 127.0.0.1)."""
    stack = start_stack(spawn, micro_llama, dtype="float32", worker_args=TP)
    assert greedy_to_length(stack.stub, [5, 6, 7, 8], 4)  # the group has run collectives
    pids = _descendants(stack.workers[0].proc.pid)
    assert len(pids) >= 2, pids  # rank 0 and rank 1
    addresses = _listening(pids)
    assert len(addresses) >= 2, addresses  # the worker's gRPC port and the store at least
    exposed = [a for a in addresses if not (a.is_loopback or _mapped_loopback(a))]
    assert not exposed, f"listening beyond loopback: {exposed} (all: {addresses})"


def _mapped_loopback(a: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(a, "ipv4_mapped", None)
    return mapped is not None and mapped.is_loopback
