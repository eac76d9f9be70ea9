"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and its top
alternatives, equal to transformers' on the same weights, across prefill chunks, with a warm
prefix cache and for n > 1."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.oracle import hf_model
from tests.procs import ServerProcess
from tests.stack import generate, start_stack

K = 3


Expected = tuple[list[int], list[float], list[list[int]], list[int]]


def hf_prompt_logprobs(
    model_dir: Path, prompt: list[int]
) -> tuple[list[float], list[list[int]], list[int]]:
    """Each prompt token's logprob after the first, the top-K ids there, and its rank."""
    model = hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    logprobs = logits.log_softmax(-1)
    positions = range(len(prompt) - 1)
    chosen = [float(logprobs[p, prompt[p + 1]]) for p in positions]
    top = [logprobs[p].topk(K).indices.tolist() for p in positions]
    ranks = [int((logprobs[p] > logprobs[p, prompt[p + 1]]).sum()) + 1 for p in positions]
    return chosen, top, ranks


@pytest.fixture(scope="module")
def prompt_and_expected(micro_llama: Path) -> Expected:
    rng = random.Random(9)
    prompt = [rng.randrange(3, 512) for _ in range(45)]
    return (prompt, *hf_prompt_logprobs(micro_llama, prompt))


def test_prompt_logprobs_equal_transformers_across_chunks_and_cache_hits(
    spawn: Callable[..., ServerProcess],
    micro_llama: Path,
    prompt_and_expected: Expected,
) -> None:
    prompt, chosen, top, ranks = prompt_and_expected
    # 45 prompt tokens in prefill chunks of at most 16.
    stack = start_stack(
        spawn, micro_llama, dtype="float64", cp_args=("--max-num-batched-tokens", "16")
    )
    for attempt in range(2):  # the second finds the prompt's blocks cached
        out = generate(stack.stub, prompt, max_tokens=3, temperature=0.0, prompt_logprobs=K)
        first, *rest = out.chunks
        assert all(not c.prompt_logprobs for c in rest)
        head, *got = first.prompt_logprobs
        assert head.token_id == prompt[0] and math.isnan(head.logprob)
        assert [g.token_id for g in got] == prompt[1:], attempt
        assert [g.logprob for g in got] == pytest.approx(chosen, abs=1e-5)
        assert [list(g.top_token_ids) for g in got] == top
        assert [g.rank for g in got] == ranks and max(ranks) > K
        assert all(len(g.top_logprobs) == K and g.token for g in got)
    assert stack.stats().prefix_cache_hit_tokens == 0

    # Without the parameter nothing is computed or sent.
    plain = generate(stack.stub, prompt, max_tokens=2, temperature=0.0)
    assert all(not c.prompt_logprobs for c in plain.chunks)


def test_prompt_logprobs_with_n_completions_come_once(
    spawn: Callable[..., ServerProcess],
    micro_llama: Path,
    prompt_and_expected: Expected,
) -> None:
    prompt, chosen, _, _ = prompt_and_expected
    stack = start_stack(spawn, micro_llama, dtype="float64")
    out = generate(stack.stub, prompt, max_tokens=4, n=3, seed=1, prompt_logprobs=0)
    sent = [c for c in out.chunks if c.prompt_logprobs]
    assert len(sent) == 1
    got = list(sent[0].prompt_logprobs)[1:]
    assert [g.logprob for g in got] == pytest.approx(chosen, abs=1e-5)
    assert all(not g.top_token_ids for g in got)
    assert {c.index for c in out.chunks} == {0, 1, 2}


def test_prompt_logprobs_out_of_range_is_invalid(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    import grpc

    stack = start_stack(spawn, micro_llama)
    with pytest.raises(grpc.RpcError) as err:
        generate(stack.stub, [5, 6, 7], max_tokens=2, prompt_logprobs=21)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in err.value.details()
