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

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.models import fused_ops
from pagedserve.model_source import smollm2_gguf
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


def test_smollm2_close_to_transformers_bf16(spawn: Callable[..., ServerProcess]) -> None:
    """The real model read from its GGUF file by both: transformers dequantizes it to bf16."""
    gguf = smollm2_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    from pagedserve.bench.chat_prompts import CHAT_PROMPTS

    prompts = []
    for text in CHAT_PROMPTS[:8]:
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    theirs = hf_greedy_top(hf_model(gguf.parent, gguf.name, torch.bfloat16), prompts, 32, TOP)
    stack = start_stack(spawn, gguf, dtype="bfloat16")
    # In bf16 greedy paths part early on this small model, transformers' own included (its bf16
    # and float32 answers to these prompts first differ at tokens 5 to 29): only the rule holds.
    check_logprobs_close(ours_greedy_top(stack, prompts, 32), theirs, "smollm2 ours/hf")


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
