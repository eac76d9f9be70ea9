"""KV memory of parallel sampling: one request with n = 4 against four separate requests.

The n = 4 request forks after its prompt, so its children share the prompt's blocks by
refcount and only their own outputs take new blocks. The report gives the peak number of KV
blocks in use (polled from the control plane's Stats while the requests run) for:

  * n = 4, one request;
  * four separate requests for the same prompt, prefix caching off (no sharing at all);
  * four separate requests, prefix caching on (shared full blocks, no fork);

and the saving of n = 4 against each, in %.

    python -m benchmarks.parallel_sampling [--preset tiny|small] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from benchmarks.common import (
    RESULTS_DIR,
    StackOptions,
    format_table,
    machine,
    model_dir,
    start_stack,
    write_json,
)
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc

N = 4


def _request(prompt: list[int], max_tokens: int, n: int, seed: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True
        )
    )
    req.token_ids.ids.extend(prompt)
    return req


def peak_blocks(
    model: Path, prompt: list[int], max_tokens: int, together: bool, caching: bool
) -> dict[str, Any]:
    opts = StackOptions(cp_args=() if caching else ("--no-prefix-caching",))
    with start_stack(model, opts) as stack:
        channel = grpc.insecure_channel(stack.address)
        stub = pb_grpc.ControlPlaneStub(channel)
        peak = {"used": 0, "refs": 0}
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                w = stub.Stats(pb.StatsRequest(), timeout=10).workers[0]
                used = w.num_gpu_blocks - w.num_free_gpu_blocks
                if used > peak["used"]:
                    peak["used"], peak["refs"] = used, w.num_gpu_block_refs
                time.sleep(0.002)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        t0 = time.perf_counter()
        if together:
            tokens = sum(
                len(m.token_ids)
                for m in stub.Generate(_request(prompt, max_tokens, N, seed=1), timeout=600)
            )
        else:

            def one(i: int) -> int:
                msgs = stub.Generate(_request(prompt, max_tokens, 1, seed=1 + i), timeout=600)
                return sum(len(m.token_ids) for m in msgs)

            with ThreadPoolExecutor(N) as pool:
                tokens = sum(pool.map(one, range(N)))
        wall = time.perf_counter() - t0
        done.set()
        poller.join()
        channel.close()
    return {
        "peak_used_blocks": peak["used"],
        "block_refs_at_peak": peak["refs"],
        "output_tokens": tokens,
        "wall_s": wall,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    p.add_argument("--quick", action="store_true", help="a short prompt (for tests)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "parallel_sampling.json")
    a = p.parse_args(argv)
    if a.quick:
        a.prompt_len, a.max_tokens = 160, 16

    model = model_dir(a.preset)
    vocab = 4096 if a.preset == "tiny" else 32000
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(a.prompt_len)]
    fork = peak_blocks(model, prompt, a.max_tokens, together=True, caching=True)
    separate = peak_blocks(model, prompt, a.max_tokens, together=False, caching=False)
    separate_cached = peak_blocks(model, prompt, a.max_tokens, together=False, caching=True)

    def saving(other: dict[str, Any]) -> float:
        return 100.0 * (1 - fork["peak_used_blocks"] / other["peak_used_blocks"])

    report = {
        "benchmark": "parallel_sampling",
        "machine": machine(),
        "config": {
            "preset": a.preset,
            "prompt_len": a.prompt_len,
            "max_tokens": a.max_tokens,
            "n": N,
            "block_size": 16,
        },
        "n4_fork": fork,
        "separate_no_caching": separate,
        "separate_prefix_caching": separate_cached,
        "saving_vs_separate_pct": saving(separate),
        "saving_vs_separate_cached_pct": saving(separate_cached),
    }
    rows = [
        [name, r["peak_used_blocks"], r["block_refs_at_peak"], r["output_tokens"]]
        for name, r in (
            ("n=4 (fork)", fork),
            ("4 requests, no caching", separate),
            ("4 requests, prefix caching", separate_cached),
        )
    ]
    print(format_table(["run", "peak KV blocks", "block refs", "output tokens"], rows))
    print(
        f"n=4 uses {report['saving_vs_separate_pct']:.1f}% fewer KV blocks than four separate "
        f"requests ({report['saving_vs_separate_cached_pct']:.1f}% fewer than four with prefix "
        "caching)"
    )
    write_json(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
