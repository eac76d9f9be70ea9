"""Admission that protects everyone else: prompts longer than any context are refused before
they are tokenized, tokenization never holds the event loop, and the waiting queue is bounded by
default (429 with Retry-After)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from control_plane.tokenizer import load_tokenizer
from protos.v1 import control_plane_pb2 as pb
from tests.gateway_stack import gateway_process
from tests.procs import ServerProcess
from tests.stack import request, start_stack

# Wall-clock bounds: run alone (`make test` runs these after the rest).
pytestmark = pytest.mark.serial


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_tokenizing_a_long_text_leaves_other_threads_running(micro_llama: Path) -> None:
    tok = load_tokenizer(micro_llama)
    text = "hello world, this is a test. " * 12_000  # ~350k characters, ~0.3 s
    ticks = 0
    done = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not done.is_set():
            time.sleep(0.001)
            ticks += 1

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.monotonic()
    ids = tok.encode(text)
    took = time.monotonic() - start
    done.set()
    ticker.join()
    assert len(ids) > 10_000
    # A tokenizer holding the GIL lets the ticker run about twice in the whole call.
    assert ticks >= min(20, took * 100), (ticks, took)


def test_overlong_prompts_are_refused_at_once_and_stall_no_stream(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    stack = start_stack(spawn, micro_llama)
    huge = "a" * 4_000_000
    # Refused by its length in characters, before any tokenizing.
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Generate(pb.GenerateRequest(text=huge), timeout=120))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "4000000 characters" in err.value.details()
    chat = pb.GenerateRequest(
        chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content=huge)])
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Generate(chat, timeout=120))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # A victim streams while another client sends a dozen 1,000,000-character prompts. Its
    # gaps while they are refused are compared with its gaps before and after, on the same
    # machine at the same time: a busy machine stretches both.
    rss_before = rss_bytes(stack.control_plane.proc.pid)
    times: list[float] = []
    victim = request([5, 6, 7], max_tokens=2000, temperature=0.0, ignore_eos=True)
    call = stack.stub.Generate(victim, timeout=1200)

    def stream() -> None:
        try:
            for _ in call:
                times.append(time.monotonic())
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.CANCELLED, exc

    def tokens_after(count: int) -> None:
        target = len(times) + count
        while len(times) < target:
            assert reader.is_alive(), "the victim's stream ended"
            time.sleep(0.01)

    def flood() -> None:
        for _ in range(12):
            with pytest.raises(grpc.RpcError):
                list(stack.stub.Generate(pb.GenerateRequest(text="b" * 1_000_000), timeout=120))

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        tokens_after(30)
        start = time.monotonic()
        flood()
        end = time.monotonic()
        tokens_after(30)
    finally:
        call.cancel()
        reader.join(120)
    gaps = [(a, b) for a, b in zip(times[1:], times[2:], strict=False)]  # past the prefill
    during = max(b - a for a, b in gaps if b > start and a < end)
    around = max(b - a for a, b in gaps if b <= start or a >= end)
    # Tokenizing one of them on the event loop took ~1 s on two quiet cores.
    assert during < max(0.75, 3 * around), (during, around)
    grown = rss_bytes(stack.control_plane.proc.pid) - rss_before
    assert grown < 150 << 20, f"control plane grew {grown >> 20} MiB"


def test_default_queue_bound_answers_429_with_retry_after(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    # One seat (--max-num-seqs 1): by default one batch may wait, one request here; the rest
    # are told at once to come back. (The pool does not bound the queue: 8 blocks of 16 tokens
    # hold one request at a time, and a burst of one batch is queued whatever the pool.)
    stack = start_stack(
        spawn, micro_llama, num_gpu_blocks=8, num_cpu_blocks=8, cp_args=("--max-num-seqs", "1")
    )
    gw = gateway_process(stack.address)
    url = gw.url
    try:
        body = {"prompt": [5] * 20, "max_tokens": 60, "ignore_eos": True, "temperature": 0}

        def post(_: int) -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", json=body, timeout=600)

        with ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(post, range(16)))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429}, codes
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                error = r.json()["error"]
                assert (
                    "waiting queue is full" in error["message"]
                    and "--max-waiting" in error["message"]
                )
            else:
                assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        gw.stop()


def waiting(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("pagedserve:num_requests_waiting"))
    return float(line.split()[-1])


@pytest.mark.timeout(1200)  # 800 tokens one request at a time: minutes on a busy machine
def test_a_batch_the_queue_bound_would_split_is_queued_whole(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    """The queue bound of the test above (one request may wait) counts a batch of prompts
    once: eight prompts that each need the whole pool are all served, one after another, where
    they would be refused every time if each counted. A lone request beside a waiting batch is
    still told to come back."""
    stack = start_stack(
        spawn, micro_llama, num_gpu_blocks=8, num_cpu_blocks=8, cp_args=("--max-num-seqs", "1")
    )
    gw = gateway_process(stack.address)
    try:
        body = {"max_tokens": 100, "ignore_eos": True, "temperature": 0}
        prompts = [[5 + i] * 20 for i in range(8)]
        with ThreadPoolExecutor(2) as pool:
            batch = pool.submit(
                httpx.post,
                f"{gw.url}/v1/completions",
                json={**body, "prompt": prompts},
                timeout=1200,
            )
            while waiting(gw.url) < 6:  # the batch is admitted: one part runs, seven wait
                assert not batch.done(), batch.result().text
                time.sleep(0.005)
            lone = httpx.post(
                f"{gw.url}/v1/completions", json={**body, "prompt": [9] * 20}, timeout=600
            )
            r = batch.result(timeout=1200)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == list(range(8))
        assert all(c["finish_reason"] == "length" for c in choices)
        assert r.json()["usage"]["completion_tokens"] == 8 * 100
        assert lone.status_code == 429, lone.text
        assert "waiting queue is full" in lone.json()["error"]["message"]
    finally:
        gw.stop()


def test_max_waiting_zero_is_refused_at_start() -> None:
    """0 would refuse every request (each waits for its first step): said at once."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pagedserve.cli", "control-plane", "--workers", "127.0.0.1:1"]
    out = subprocess.run([*cmd, "--max-waiting", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--max-waiting: must be >= 1 or auto, got 0" in out.stderr
    assert "Traceback" not in out.stderr
