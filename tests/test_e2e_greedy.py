"""End to end, real processes: greedy output equals transformers token for token, with
continuous batching, chunked prefill and preemption (recompute and swap) all happening."""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MICRO
from tests.oracle import hf_greedy
from tests.procs import ServerProcess
from tests.stack import greedy_to_length, start_stack

ARCHS: dict[str, dict[str, Any]] = {
    "llama": MICRO,  # GQA 4:2
    "mistral": MICRO,
    "qwen2": {**MICRO, "num_key_value_heads": 4},  # MHA, qkv bias
    "qwen3": {**MICRO, "head_dim": 32},  # q/k norm, explicit head_dim
}
NUM_REQUESTS = 24
# 48 blocks of 16 = 768 token slots for 24 requests of up to 500 tokens: preemption is certain.
NUM_GPU_BLOCKS = 48
MAX_BATCHED_TOKENS = 64  # well below the longest prompts: chunked prefill is certain


def workload(vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1234)
    lengths = [1, 300, 15, 16, 17, 32] + [rng.randint(1, 300) for _ in range(NUM_REQUESTS - 6)]
    max_tokens = [200, 1, 50] + [rng.randint(1, 200) for _ in range(NUM_REQUESTS - 3)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    return prompts, max_tokens


@pytest.fixture(scope="module", params=list(ARCHS))
def case(
    request: pytest.FixtureRequest, make_checkpoint: Callable[..., Path]
) -> tuple[Path, list[list[int]], list[int], list[list[int]]]:
    arch = request.param
    model_dir = make_checkpoint(arch, seed=7, **ARCHS[arch])
    prompts, max_tokens = workload(ARCHS[arch]["vocab_size"])
    expected = hf_greedy(model_dir, prompts, max_tokens)
    return model_dir, prompts, max_tokens, expected


@pytest.mark.parametrize(
    ("preemption", "scheduling"), [("recompute", "async"), ("swap", "async"), ("recompute", "sync")]
)
def test_greedy_matches_transformers(
    case: tuple[Path, list[list[int]], list[int], list[list[int]]],
    preemption: str,
    scheduling: str,
    spawn: Callable[..., ServerProcess],
) -> None:
    model_dir, prompts, max_tokens, expected = case
    stack = start_stack(
        spawn,
        model_dir,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        num_cpu_blocks=512,
        dtype="float64",
        cp_args=(
            "--preemption",
            preemption,
            "--max-num-batched-tokens",
            str(MAX_BATCHED_TOKENS),
            "--max-num-seqs",
            "16",
            # Every request at once, more than the pool holds: preemption is the point here.
            "--max-waiting",
            "1024",
            *(["--no-async-scheduling"] if scheduling == "sync" else []),
        ),
    )

    def run(i: int) -> list[int]:
        return greedy_to_length(stack.stub, prompts[i], max_tokens[i])

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        got = list(pool.map(run, range(NUM_REQUESTS)))

    for i in range(NUM_REQUESTS):
        assert got[i] == expected[i], f"request {i} (prompt {len(prompts[i])} tokens) differs"

    stats = stack.stats()
    w = stats.workers[0]
    assert stats.num_preemptions > 0
    assert stats.num_chunked_prefill_steps > 0
    if preemption == "swap":
        assert w.num_swap_preemptions > 0 and w.num_blocks_swapped_in > 0
    else:
        assert w.num_recompute_preemptions > 0
    # Everything finished: every block is back in the pool.
    assert w.num_free_gpu_blocks == w.num_gpu_blocks
    assert w.num_free_cpu_blocks == w.num_cpu_blocks
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
