"""bfloat16 end to end, tested as vLLM tests half precision.

Exactness is float64's job (test_e2e_greedy, test_smollm2). In bf16 two correct engines round
differently and their greedy paths may part; what must hold is `check_logprobs_close`'s rule:
where two greedy outputs first differ, each side's token is among the other side's top-5 at
that step (after that the paths are different continuations and are not compared). Held here
against transformers in bf16 on the same weights (random presets covering GQA, biases and
Qwen3's norms, and SmolLM2's real weights), and against our own float32 on 64 prompts. Our
side runs as real worker and control-plane processes with `--dtype bfloat16`.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker import cpu_isa
from gpu_worker.models import fused_ops
from pagedserve.cli.model_source import ensure_default_model
from tests.oracle import hf_greedy_top, hf_model
from tests.procs import ServerProcess
from tests.stack import Stack, generate, start_stack

transformers = pytest.importorskip("transformers")
TOP = 5
Output = tuple[list[int], list[set[int]]]


def check_logprobs_close(ours: list[Output], theirs: list[Output], names: str) -> int:
    """The rule above for every prompt; returns how many outputs were equal throughout."""
    equal = 0
    for i, ((a, a_top), (b, b_top)) in enumerate(zip(ours, theirs, strict=True)):
        assert len(a) == len(b), f"prompt {i}: {len(a)} vs {len(b)} tokens"
        for pos, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                assert x in b_top[pos] and y in a_top[pos], (
                    f"{names}, prompt {i}, step {pos}: {x} vs {y}, top-{TOP} "
                    f"{sorted(a_top[pos])} vs {sorted(b_top[pos])}"
                )
                break
        else:
            equal += 1
    return equal


def ours_greedy_top(stack: Stack, prompts: list[list[int]], max_tokens: int) -> list[Output]:
    outs = []
    for prompt in prompts:
        c = generate(
            stack.stub, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
            logprobs=TOP,
        )  # fmt: skip
        lps = [lp for chunk in c.chunks for lp in chunk.logprobs]
        assert len(lps) == len(c.token_ids) == max_tokens
        outs.append((c.token_ids, [set(lp.top_token_ids) for lp in lps]))
    return outs


def _prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 40))] for _ in range(num)]


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),  # GQA 8:4
        ("qwen2", {"num_hidden_layers": 2}),  # MHA with q/k/v biases
        ("qwen3", {"num_hidden_layers": 2}),  # q/k norms, head_dim != hidden / heads
    ],
)
def test_random_presets_close_to_transformers_bf16(
    arch: str,
    overrides: dict[str, Any],
    make_checkpoint: Callable[..., Path],
    spawn: Callable[..., ServerProcess],
) -> None:
    model_dir = make_checkpoint(arch, **overrides)
    prompts = _prompts(6, 4096, seed=len(arch))
    hf = hf_model(model_dir, dtype=torch.bfloat16)
    theirs = hf_greedy_top(hf, prompts, 16, TOP)
    stack = start_stack(spawn, model_dir, dtype="bfloat16")
    info = stack.stats().workers[0]
    assert (info.dtype, info.kv_cache_dtype) == ("bfloat16", "bfloat16")
    check_logprobs_close(ours_greedy_top(stack, prompts, 16), theirs, f"{arch} ours/hf")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_widened_bf16_close_to_transformers_bf16(
    arch: str,
    make_checkpoint: Callable[..., Path],
    spawn: Callable[..., ServerProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The path of CPUs without bf16 products (projections widened to float32, forced here on
    any CPU) under the same rule."""
    monkeypatch.setenv("PAGEDSERVE_BF16_WIDEN", "1")
    model_dir = make_checkpoint(arch, num_hidden_layers=2)
    prompts = _prompts(6, 4096, seed=7)
    theirs = hf_greedy_top(hf_model(model_dir, dtype=torch.bfloat16), prompts, 16, TOP)
    stack = start_stack(spawn, model_dir, dtype="bfloat16")
    assert '"projections": "onednn-float32-widened"' in stack.worker.output()
    check_logprobs_close(ours_greedy_top(stack, prompts, 16), theirs, f"{arch} widened/hf")


@pytest.mark.parametrize(
    ("arch", "products"),
    [
        ("llama", "team-bfloat16"),
        ("qwen2", "team-bfloat16"),
        ("llama", "team-float32-widened"),
        ("qwen2", "team-bfloat16-model"),
        ("llama", "team-bfloat16-amx"),
    ],
)
def test_bf16_on_the_cpu_team_close_to_transformers_bf16(
    arch: str,
    products: str,
    make_checkpoint: Callable[..., Path],
    spawn: Callable[..., ServerProcess],
) -> None:
    """The CPU team's bf16 products (a worker whose threads are bound, on a CPU with
    AVX512-BF16 and no AMX: tests/test_cpu_team.py), its float32 products of a widened bf16
    model (any CPU), and its products on AMX tiles (the CPU's, and their software model on any
    CPU with AVX512-BF16), under the same rule."""
    from gpu_worker import cpu_team

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the team runs where the worker has two cores or more")
    if products == "team-bfloat16" and cpu_isa.bf16_isa() != "avx512_bf16":
        pytest.skip("the team takes bf16 products on AVX512-BF16 without AMX (or on tiles)")
    if products == "team-bfloat16-amx" and cpu_isa.bf16_isa() != "amx_bf16":
        pytest.skip("the CPU has no AMX")
    if products == "team-bfloat16-amx" and cpu_team.set_tiles("amx") != "amx":
        pytest.skip("Linux refuses the tiles' state to this process, or the build has no AMX")
    if products == "team-bfloat16-model" and cpu_team.set_tiles("model") != "model":
        pytest.skip("the tiles take AVX512-BF16's panels of 32 columns")
    cpu_team.set_tiles("off")
    model_dir = make_checkpoint(arch, num_hidden_layers=2)
    prompts = _prompts(6, 4096, seed=11)
    theirs = hf_greedy_top(hf_model(model_dir, dtype=torch.bfloat16), prompts, 16, TOP)
    env: dict[str, str | None] = {"OMP_NUM_THREADS": None}
    if products.endswith("widened"):  # float32 panels of the bf16 weights (no bf16 products)
        env["PAGEDSERVE_BF16_WIDEN"] = "1"
    env[cpu_team.TILES_SWITCH] = "model" if products.endswith("-model") else None  # AMX: tiles
    stack = start_stack(spawn, model_dir, dtype="bfloat16", worker_env=env)
    assert f'"projections": "{products}"' in stack.worker.output()
    check_logprobs_close(ours_greedy_top(stack, prompts, 16), theirs, f"{arch} {products}/hf")


def test_smollm2_close_to_transformers_bf16(spawn: Callable[..., ServerProcess]) -> None:
    """The real model, converted from its GGUF file (tests/test_smollm2.py holds the conversion
    to transformers' own reading of the file), in bf16 on both sides."""
    model = ensure_default_model()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    from pagedserve.cli.bench.chat_prompts import CHAT_PROMPTS

    prompts = []
    for text in CHAT_PROMPTS[:6]:
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    hf = hf_model(model, dtype=torch.bfloat16)
    theirs = hf_greedy_top(hf, prompts, 24, TOP, batch_size=len(prompts))
    stack = start_stack(spawn, model, dtype="bfloat16")
    # In bf16 greedy paths part early on this small model, transformers' own included (its bf16
    # and float32 answers to these prompts first differ at tokens 5 to 29): only the rule holds.
    check_logprobs_close(ours_greedy_top(stack, prompts, 24), theirs, "smollm2 ours/hf")


def test_bf16_close_to_our_float32_on_64_prompts(
    make_checkpoint: Callable[..., Path], spawn: Callable[..., ServerProcess]
) -> None:
    model_dir = make_checkpoint("llama")
    prompts = _prompts(64, 4096, seed=64)
    results = {}
    for dtype in ("float32", "bfloat16"):
        stack = start_stack(spawn, model_dir, dtype=dtype, num_gpu_blocks=512)
        results[dtype] = ours_greedy_top(stack, prompts, 12)
    equal = check_logprobs_close(results["bfloat16"], results["float32"], "bf16/fp32")
    assert equal >= 8, "random weights are decisive enough that some paths never part"


def test_fused_ops_serve_bf16_on_cpu(make_checkpoint: Callable[..., Path]) -> None:
    """The bf16 model on a CPU takes the fused elementwise path where the C code builds."""
    from gpu_worker.checkpoint import load_model

    model = load_model(make_checkpoint("llama"), dtype=torch.bfloat16)
    if fused_ops.load() is None:
        pytest.skip("no C compiler here")
    assert model.ops.name == "fused-bf16"


def test_bf16_blocks_swap_and_copy_bit_for_bit() -> None:
    """The swap pool holds bf16 blocks: out and back in, and copy-on-write copies, move the
    exact bits of every layer's K and V."""
    from gpu_worker.kv_cache import CacheGeometry, KVCache
    from pagedserve.plan import BlockMove

    cache = KVCache(CacheGeometry(3, 2, 32, 16, torch.bfloat16), 8, 4, "cpu")
    assert cache.kv.dtype == cache.cpu_kv.dtype == torch.bfloat16
    cache.kv.copy_(torch.randn(cache.kv.shape).to(torch.bfloat16))
    before = cache.kv.clone()
    cache.swap_out([BlockMove(5, 1), BlockMove(2, 3)])
    cache.kv[:, :, [2, 5]] = 0
    cache.swap_in([BlockMove(1, 5), BlockMove(3, 2)])
    cache.copy_blocks([BlockMove(5, 7)])
    assert torch.equal(cache.kv[:, :, :7].view(torch.int16), before[:, :, :7].view(torch.int16))
    assert torch.equal(cache.kv[:, :, 7].view(torch.int16), before[:, :, 5].view(torch.int16))


def test_bf16_under_swap_preemption(
    make_checkpoint: Callable[..., Path], spawn: Callable[..., ServerProcess]
) -> None:
    """A pool too small for the batch: requests are swapped out (bf16 blocks to the host) and
    back; every answer still satisfies the rule against a roomy bf16 run, and every block is
    returned."""
    from concurrent.futures import ThreadPoolExecutor

    model_dir = make_checkpoint("llama")
    prompts = _prompts(12, 4096, seed=12)
    prompts = [p * 6 for p in prompts]  # 24..240 tokens
    results = {}
    for blocks in (512, 40):
        stack = start_stack(
            spawn, model_dir, dtype="bfloat16", num_gpu_blocks=blocks, num_cpu_blocks=512,
            # All at once, more than the pool holds: swapping is the point, not admission.
            cp_args=("--preemption", "swap", "--max-num-seqs", "12", "--max-waiting", "1024"),
        )  # fmt: skip

        def one(prompt: list[int], stack: Stack = stack) -> Output:
            return ours_greedy_top(stack, [prompt], 40)[0]

        with ThreadPoolExecutor(len(prompts)) as pool:
            results[blocks] = list(pool.map(one, prompts))
        stats = stack.stats()
        w = stats.workers[0]
        if blocks == 40:
            assert w.num_swap_preemptions > 0 and w.num_blocks_swapped_in > 0
        assert w.num_free_gpu_blocks == w.num_gpu_blocks
        assert w.num_free_cpu_blocks == w.num_cpu_blocks
    check_logprobs_close(results[40], results[512], "swapped/roomy")
