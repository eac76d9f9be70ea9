"""The correctness oracle: Hugging Face transformers' greedy decoding on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    *,
    gguf_file: str | None = None,
    eos_ids: tuple[int, ...] = (),
    model: Any = None,
) -> list[list[int]]:
    """Greedy continuation of every prompt, one at a time, in float64, until `max_tokens` or
    (when `eos_ids` is given) an EOS token, which is kept as the last output token.

    Also asserts that along each greedy path the top-2 logit gap stays far above float64 (and
    our float64 path's) rounding, so an equal output is a real match, not a lucky tie-break.
    `gguf_file` loads the GGUF file of that name in `model_dir`, as transformers reads it;
    `model` reuses an already loaded one.
    """
    if model is None:
        model = hf_model(model_dir, gguf_file)
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
                if tok in eos_ids:
                    break
                ids = torch.tensor([[tok]])
            outs.append(out)
    return outs


def hf_greedy_top(
    model: Any, prompts: list[list[int]], max_tokens: int, k: int = 5
) -> list[tuple[list[int], list[set[int]]]]:
    """Greedy continuation of every prompt by a loaded transformers `model` (any dtype), with
    the ids of the `k` most likely tokens at every step: [(output ids, top-k id sets)]."""
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            past = None
            out: list[int] = []
            tops: list[set[int]] = []
            for _ in range(max_tokens):
                res = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                logits = res.logits[0, -1].float()
                tops.append(set(torch.topk(logits, k).indices.tolist()))
                out.append(int(torch.argmax(logits)))
                ids = torch.tensor([[out[-1]]])
            outs.append((out, tops))
    return outs


def hf_model(
    model_dir: Path, gguf_file: str | None = None, dtype: torch.dtype = torch.float64
) -> Any:
    """transformers' model of `model_dir` (or of its GGUF file `gguf_file`), in float64 unless
    `dtype` says otherwise.

    A GGUF is unpacked into dense weights of that dtype at load (transformers would otherwise
    keep the blocks and run its matmuls in float32, which is not the oracle's precision).
    """
    from transformers import AutoModelForCausalLM, GgufConfig

    kwargs: dict[str, Any] = {}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
        kwargs["quantization_config"] = GgufConfig(gguf_file=gguf_file, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    return model.eval()
