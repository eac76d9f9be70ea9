"""The correctness oracle: Hugging Face transformers' greedy decoding on the same weights."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy continuation of every prompt, one at a time, in float64, ignoring EOS.

    Also asserts that along each greedy path the top-2 logit gap stays far above float64 (and
    our float64 path's) rounding, so an equal output is a real match, not a lucky tie-break.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model.eval()
    outs: list[list[int]] = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            ids = torch.tensor([prompt])
            past = None
            out: list[int] = []
            for _ in range(n):
                res = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                logits = res.logits[0, -1]
                top2 = torch.topk(logits, 2).values
                assert float(top2[0] - top2[1]) > 1e-9, "near-tie on the greedy path"
                tok = int(torch.argmax(logits))
                out.append(tok)
                ids = torch.tensor([[tok]])
            outs.append(out)
    return outs
