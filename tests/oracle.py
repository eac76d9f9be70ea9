"""The correctness oracle: Hugging Face transformers' greedy decoding on the same weights."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    batch_size: int = 1,
) -> list[list[int]]:
    """Greedy continuation of every prompt, in float64, until `max_tokens` or (when `eos_ids`
    is given) an EOS token, which is kept as the last output token; `batch_size` prompts at a
    time (left padded, with their attention mask and positions).

    Also asserts that along each greedy path the top-2 logit gap stays far above float64 (and
    our float64 path's) rounding, so an equal output is a real match, not a lucky tie-break.
    `gguf_file` loads the GGUF file of that name in `model_dir`, as transformers reads it;
    `model` reuses an already loaded one.
    """
    if model is None:
        model = hf_model(model_dir, gguf_file)

    def pick(logits: torch.Tensor, i: int) -> int:
        top2 = torch.topk(logits, 2).values
        assert float(top2[0] - top2[1]) > 1e-9, "near-tie on the greedy path"
        return int(torch.argmax(logits))

    return _greedy(model, prompts, max_tokens, eos_ids, batch_size, pick)


def hf_greedy_top(
    model: Any, prompts: list[list[int]], max_tokens: int, k: int = 5, batch_size: int = 1
) -> list[tuple[list[int], list[set[int]]]]:
    """Greedy continuation of every prompt by a loaded transformers `model` (any dtype), with
    the ids of the `k` most likely tokens at every step: [(output ids, top-k id sets)]."""
    tops: list[list[set[int]]] = [[] for _ in prompts]

    def pick(logits: torch.Tensor, i: int) -> int:
        logits = logits.float()
        tops[i].append(set(torch.topk(logits, k).indices.tolist()))
        return int(torch.argmax(logits))

    outs = _greedy(model, prompts, [max_tokens] * len(prompts), (), batch_size, pick)
    return list(zip(outs, tops, strict=True))


def _greedy(
    model: Any,
    prompts: list[list[int]],
    max_tokens: list[int],
    eos_ids: tuple[int, ...],
    batch_size: int,
    pick: Callable[[torch.Tensor, int], int],
) -> list[list[int]]:
    """Greedy decoding, `batch_size` prompts at a time: `pick(last logits, prompt index)`
    chooses each row's token."""
    outs: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            rows = list(range(first, min(first + batch_size, len(prompts))))
            width = max(len(prompts[i]) for i in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, i in enumerate(rows):
                ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[r, width - len(prompts[i]) :] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            live = set(range(len(rows)))
            past = None
            while live:
                res = model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=past,
                    use_cache=True,
                )
                past = res.past_key_values
                ids = torch.zeros((len(rows), 1), dtype=torch.long)
                for r in sorted(live):
                    i = rows[r]
                    logits = res.logits[r, -1]
                    tok = pick(logits, i)
                    outs[i].append(tok)
                    ids[r, 0] = tok
                    if tok in eos_ids or len(outs[i]) >= max_tokens[i]:
                        live.discard(r)
                mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
                positions = positions[:, -1:] + 1
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
    with shared_gguf_reads():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    return model.eval()


def hf_gguf_tokenizer(gguf: Path) -> Any:
    """transformers' tokenizer of a GGUF file, as it reads the file itself."""
    from transformers import AutoTokenizer

    with shared_gguf_reads():
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


_readers: dict[tuple[str, int, int], Any] = {}


@contextmanager
def shared_gguf_reads() -> Iterator[None]:
    """While transformers loads a GGUF: one `gguf.GGUFReader` per file version and one tensor
    name map per (architecture, layers), reused.

    transformers parses a file's fields anew for the config, the tokenizer and the weights
    (5 s each for SmolLM2's 49,152-entry vocabulary) and rebuilds the same name map once per
    tensor (9 s per load); both depend on their arguments alone, so what it reads is unchanged.
    """
    import gguf

    make_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path: Any, mode: str = "r") -> Any:
        if mode != "r":
            return make_reader(path, mode)
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        if key not in _readers:
            _readers[key] = make_reader(path, mode)
        return _readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map
