"""GGUF tensors under Hugging Face names: renamed, dequantized, Q/K rows put back in HF order.

Names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`, and so on (`_RENAMES`).
Shapes: GGUF lists dimensions fastest-first (`[in, out]`); the reader's arrays and ours are
`[out, in]` like HF's.

llama.cpp's converter reorders the rows of the Q and K projections of `llama` models so that
its rotary embedding can rotate adjacent pairs (GPT-J style) where HF rotates halves (NeoX
style). Per head of D rows it wrote HF row `h*D + s*D/2 + j` (s in {0, 1}, j < D/2) at
`h*D + 2*j + s`; `_unpermute` reads them back:

    HF    [x0 x1 x2 x3 | y0 y1 y2 y3]      (two halves of one head)
    GGUF  [x0 y0 x1 y1 x2 y2 x3 y3]

Other architectures (qwen2, qwen3) are stored unpermuted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedserve.gguf.errors import GGUFError

if TYPE_CHECKING:
    import torch
    from gguf import ReaderTensor

_GLOBAL_RENAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RENAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_HF_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# Architectures whose Q/K rows llama.cpp's converter permuted.
PERMUTED_ARCHITECTURES = ("llama", "mistral")


def _supported_types() -> dict[int, str]:
    from gguf import GGMLQuantizationType as Q

    kinds = "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K".split()
    return {int(Q[k]): k for k in kinds}


def hf_name(gguf_name: str) -> str:
    """The HF name of a GGUF tensor; ValueError for a tensor no supported model has."""
    if gguf_name in _GLOBAL_RENAMES:
        return _GLOBAL_RENAMES[gguf_name]
    m = _LAYER_NAME.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_RENAMES:
        raise ValueError(f"unsupported tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_RENAMES[m.group(2)]}.{m.group(3)}"


def gguf_name(name: str) -> str:
    """The GGUF name of an HF tensor name (inverse of `hf_name`)."""
    for g, h in _GLOBAL_RENAMES.items():
        if h == name:
            return g
    m = _HF_LAYER_NAME.match(name)
    if m is not None:
        for g, h in _LAYER_RENAMES.items():
            if h == m.group(2):
                return f"blk.{m.group(1)}.{g}.{m.group(3)}"
    raise KeyError(name)


def check_tensors(path: Path, tensors: Sequence[ReaderTensor]) -> None:
    """Every tensor of the file at `path` has a known name and a type that can be dequantized
    here."""
    supported = _supported_types()
    for t in tensors:
        if t.name == "rope_freqs.weight":
            raise GGUFError(
                f"{path}: rope_freqs.weight (per-frequency RoPE factors, Llama 3.1's "
                "scaling) is not supported"
            )
        try:
            hf_name(t.name)
        except ValueError as exc:
            raise GGUFError(f"{path}: {exc} (not part of a llama-family model)") from exc
        if int(t.tensor_type) not in supported:
            raise GGUFError(
                f"{path}: tensor {t.name} is stored as {t.tensor_type.name}, which is not "
                f"supported; supported types: {', '.join(supported.values())}"
            )
    if not any(t.name == "token_embd.weight" for t in tensors):
        raise GGUFError(f"{path}: no token_embd.weight tensor")


def read_tensor(
    raw: ReaderTensor, name: str, heads: tuple[int, int] | None, dtype: torch.dtype | None
) -> torch.Tensor:
    """Tensor `raw`, whose HF name is `name`, dequantized to float32, in HF row order, as
    `dtype` (float32 when None). `heads` (query heads, KV heads) is given for an architecture
    whose Q/K rows llama.cpp permuted (`PERMUTED_ARCHITECTURES`), None for the others."""
    import torch  # only tensor reads need it: the control plane reads metadata alone
    from gguf import quants

    array: np.ndarray[Any, Any] = quants.dequantize(raw.data, raw.tensor_type)
    shape = tuple(int(d) for d in reversed(raw.shape))
    array = array.reshape(shape)
    if heads is not None:
        layer = _HF_LAYER_NAME.match(name)
        part = layer.group(2) if layer else ""
        if part == "self_attn.q_proj":
            array = _unpermute(array, heads[0])
        elif part == "self_attn.k_proj":
            array = _unpermute(array, heads[1])
    tensor = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))  # a writable copy
    return tensor if dtype is None else tensor.to(dtype)


def _unpermute(array: np.ndarray[Any, Any], num_heads: int) -> np.ndarray[Any, Any]:
    rows = array.shape[0]
    return (
        array.reshape(num_heads, rows // num_heads // 2, 2, *array.shape[1:])
        .swapaxes(1, 2)
        .reshape(array.shape)
    )


def permute(array: np.ndarray[Any, Any], num_heads: int) -> np.ndarray[Any, Any]:
    """HF row order -> llama.cpp's (what its converter writes; the inverse of `_unpermute`)."""
    rows = array.shape[0]
    return (
        array.reshape(num_heads, 2, rows // num_heads // 2, *array.shape[1:])
        .swapaxes(1, 2)
        .reshape(array.shape)
    )
