"""End to end with the Triton kernels: a real worker with `--attention-backend triton` (on a
CUDA GPU where there is one and the interpreter is off; else on the CPU, under the Triton
interpreter that conftest enables for child processes too) and a real
control plane give greedy output equal to transformers token for token, with a chunked
prefill and a preemption (recompute, then swap) happening on the way."""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from protos.v1 import worker_pb2, worker_pb2_grpc
from tests.kernel_refs import DEVICE
from tests.oracle import hf_greedy
from tests.procs import ServerProcess
from tests.stack import generate, start_stack

# head_dim 128 / 2 = 64 and GQA 2:1, inside the kernels' envelope; one layer keeps the
# interpreter's per-program cost small.
MODEL = {
    "hidden_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
    "vocab_size": 512,
}
PROMPT_LENS = [5, 23, 40, 12, 17]
MAX_TOKENS = [12, 9, 10, 8, 6]
# 4 blocks of 16 = 64 token slots; the requests need 12 blocks together and a running one
# must grow past what is free: preemption is certain.
NUM_GPU_BLOCKS = 4
MAX_BATCHED_TOKENS = 16  # below the longer prompts: chunked prefill is certain


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_triton_backend_greedy_matches_transformers(
    preemption: str, make_checkpoint: Callable[..., Path], spawn: Callable[..., ServerProcess]
) -> None:
    model_dir = make_checkpoint("llama", seed=7, **MODEL)
    rng = random.Random(99)
    prompts = [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)

    stack = start_stack(
        spawn,
        model_dir,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        dtype="float32",
        worker_args=("--attention-backend", "triton", "--device", DEVICE),
        cp_args=(
            "--preemption",
            preemption,
            "--max-num-batched-tokens",
            str(MAX_BATCHED_TOKENS),
            "--max-num-seqs",
            "8",
            # Every request at once, more than the pool holds: preemption is the point here.
            "--max-waiting",
            "1024",
        ),
    )

    def run(i: int) -> list[int]:
        out = generate(
            stack.stub, prompts[i], max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True
        )
        assert out.finish_reason == "length"
        return out.token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(run, range(len(prompts))))

    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"request {i} (prompt {PROMPT_LENS[i]} tokens) differs"
    with grpc.insecure_channel(stack.worker.address) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest())
    assert info.attention_backend == "triton"
    stats = stack.stats()
    assert stats.num_chunked_prefill_steps > 0
    assert stats.num_preemptions > 0
    w = stats.workers[0]
    if preemption == "swap":
        assert w.num_swap_preemptions > 0 and w.num_blocks_swapped_in > 0
    else:
        assert w.num_recompute_preemptions > 0
