"""GGUF files for tests, written with the `gguf` package the way llama.cpp's converter does.

`write_gguf(hf_dir, out)` turns a random-weight HF checkpoint (`model_init`) into a GGUF: the
architecture's metadata, the byte-level tokenizer with its merges and chat template, and every
tensor quantized to the type `types` picks for it. Q/K rows of `llama` models are permuted as
llama.cpp does. K-quants (which `gguf` can dequantize but not quantize) are random well-formed
blocks: scales drawn so the weights keep the checkpoint's spread.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from pagedserve.gguf.tensors import gguf_name, permute

Q = GGMLQuantizationType
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
CONTROL, NORMAL = 3, 1

# A mix that exercises every supported kind at least once in a two-layer model.
MIXED_TYPES: dict[str, GGMLQuantizationType] = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q6_K,
    "attn_v": Q.Q4_0,
    "attn_output": Q.Q4_1,
    "ffn_gate": Q.Q5_0,
    "ffn_up": Q.BF16,
    "ffn_down": Q.F16,
    "output": Q.Q8_0,
}


def mixed_types(name: str, shape: tuple[int, ...]) -> GGMLQuantizationType:
    if len(shape) == 1:
        return Q.F32  # norms and biases stay float32, as llama.cpp keeps them
    kind = name.split(".")[-2]
    return MIXED_TYPES.get(kind, Q.F32)


def write_gguf(
    hf_dir: Path,
    out: Path,
    types: Callable[[str, tuple[int, ...]], GGMLQuantizationType] = mixed_types,
    *,
    pre: str = "gpt2",
    seed: int = 0,
) -> Path:
    config = json.loads((hf_dir / "config.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads

    w = GGUFWriter(str(out), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    _add_tokenizer(w, hf_dir, tok_config, pre)

    rng = np.random.default_rng(seed)
    for name, array in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        gname = gguf_name(name)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = permute(array, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = permute(array, kv_heads)
        qtype = types(gname, array.shape)
        if qtype == Q.F32:
            w.add_tensor(gname, array.astype(np.float32))
        elif qtype in (Q.Q4_K, Q.Q6_K):
            blocks = _random_k_blocks(array, qtype, rng)
            w.add_tensor(gname, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
        else:
            data = quants.quantize(array.astype(np.float32), qtype)
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w: GGUFWriter, hf_dir: Path, tok_config: dict, pre: str) -> None:
    tok = json.loads(Tokenizer.from_file(str(hf_dir / "tokenizer.json")).to_str())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([CONTROL if t in special else NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tok_config["bos_token"]])
    w.add_eos_token_id(vocab[tok_config["eos_token"]])
    w.add_pad_token_id(vocab[tok_config["pad_token"]])
    w.add_add_bos_token(True)
    w.add_chat_template(tok_config["chat_template"])


def _random_k_blocks(
    array: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator
) -> np.ndarray:
    """Well-formed random super-blocks of `qtype` for a tensor shaped like `array`.

    The quantized values are random bytes; only the float16 scales are set, so the weights'
    spread is about `array`'s (Q4_K: d*sc*q - dmin*m with 6-bit sc, m and 4-bit q; Q6_K:
    d*sc*(q - 32) with int8 sc and 6-bit q).
    """
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols = array.shape
    assert cols % block_elems == 0, f"{qtype.name} needs rows of a multiple of {block_elems}"
    n = rows * cols // block_elems
    raw = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    std = float(array.std())
    if qtype == Q.Q4_K:
        # [d f16][dmin f16][scales 12][qs 128]; mean of d*sc*q is ~d*32*7.5, cancelled by dmin*m.
        d = np.full(n, std / (32 * 4.6), dtype=np.float16)
        raw[:, 0:2] = d.view(np.uint8).reshape(n, 2)
        raw[:, 2:4] = (d * np.float16(7.5)).view(np.uint8).reshape(n, 2)
    else:
        # [ql 128][qh 64][scales 16 int8][d f16]; q - 32 is centred, sc spreads it.
        d = np.full(n, std / (74 * 18.5), dtype=np.float16)
        raw[:, 208:210] = d.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, cols // block_elems * block_bytes)
