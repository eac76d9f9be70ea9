"""Write random-weight checkpoints in exactly the HF on-disk format, without transformers.

A checkpoint directory holds `config.json`, `generation_config.json`, `model.safetensors`
(or shards plus `model.safetensors.index.json`), `tokenizer.json` and `tokenizer_config.json`.
Output is a pure function of (preset, arch, seed, overrides, shards): same bytes every time.

Weights are wider than the usual std-0.02 init on purpose. At 0.02 a random model's greedy
output collapses into short loops and its top-2 logits nearly tie (~1e-5 apart), so any
numerical noise flips tokens; exactness tests against transformers need decisive argmaxes.

The tokenizer is a byte-level BPE: `<pad>`, `<s>`, `</s>` (ids 0-2), the 256 byte tokens, then
generated merges up to exactly `vocab_size`, so every id the model can emit decodes.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from pagedserve.gguf.tokenizer import byte_chars

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 688,
        "vocab_size": 4096,
        "max_position_embeddings": 2048,
    },
    "small": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "intermediate_size": 2048,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
}
ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Init scale (see the module docstring). A matrix with fan-in n is N(0, INIT_GAIN / sqrt(n)),
# so every projection (and the logits) has the same scale whatever the model size; the
# embedding is drawn like the LM head, so tying changes nothing. Norm weights are
# N(1, NORM_STD); the final norm is scaled up as well, which sharpens the next-token
# distribution (mean entropy ~1.5 nats, like a trained model's) without moving argmaxes.
INIT_GAIN = 1.6
BIAS_STD = 0.1
NORM_STD = 0.1
FINAL_NORM_SCALE = 4.0

# Letters in English frequency order, given geometrically falling probabilities, plus "Ġ",
# the byte-level space that starts a word: the generated merges favour likely letter strings,
# so English text gets about two bytes per token.
_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
_WORD_START = "\u0120"
_P = {_WORD_START: 0.2, **{c: 0.15 * 0.85**rank for rank, c in enumerate(_LETTERS)}}


def write_random_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    arch: str = "llama",
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
    shards: int = 1,
) -> Path:
    """Write a random-weight HF checkpoint into `out_dir` (created if needed); return it.

    `overrides` replaces config.json fields after the preset (e.g. `hidden_size`,
    `tie_word_embeddings`, `rope_parameters`); fields derived from others (`head_dim`,
    Qwen2's MHA `num_key_value_heads`) follow the overridden values unless overridden too.
    A classic `rope_theta` / `rope_scaling` override replaces `rope_parameters`. `shards > 1`
    splits the weights over that many files with an index.
    """
    config = build_config(preset, arch, overrides)
    if config["vocab_size"] < len(SPECIAL_TOKENS) + 256:
        raise ValueError("vocab_size must be at least 259 for a byte-level tokenizer")
    if shards < 1:
        raise ValueError(f"shards must be positive, got {shards}")
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    _write_json(path / "config.json", config)
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID},
    )
    _write_weights(path, random_weights(config, seed), shards)
    build_tokenizer(config["vocab_size"]).save(str(path / "tokenizer.json"), pretty=True)
    _write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": SPECIAL_TOKENS[BOS_ID],
            "eos_token": SPECIAL_TOKENS[EOS_ID],
            "pad_token": SPECIAL_TOKENS[PAD_ID],
            "model_max_length": config["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    return path


def build_config(
    preset: str = "tiny", arch: str = "llama", overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The `config.json` contents for `preset` and `arch` with `overrides` applied."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    overrides = dict(overrides or {})
    base = {**PRESETS[preset], **overrides}
    heads = base["num_attention_heads"]
    architecture, model_type = ARCHS[arch]
    config: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
    config.update(PRESETS[preset])
    if arch == "qwen2":
        config["num_key_value_heads"] = heads  # Qwen2 preset: plain multi-head attention
    else:
        # Qwen3 checkpoints state head_dim and it need not be hidden/heads; exercise that.
        scale = 2 if arch == "qwen3" else 1
        config["head_dim"] = scale * base["hidden_size"] // heads
    config.update(
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.02,
        attention_dropout=0.0,
        use_cache=True,
        dtype="float32",
        torch_dtype="float32",
    )
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = False
    if arch == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    if arch == "mistral":
        config["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None)
        config["max_window_layers"] = base["num_hidden_layers"]
    if "rope_theta" in overrides or "rope_scaling" in overrides:
        del config["rope_parameters"]
    config.update(overrides)
    return config


def random_weights(config: Mapping[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Float32 tensors under HF names for `config`, drawn from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, mean: float = 0.0, std: float | None = None) -> torch.Tensor:
        if std is None:
            std = INIT_GAIN / shape[-1] ** 0.5  # a matrix: scale by its fan-in
        return torch.randn(*shape, generator=gen) * std + mean

    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    model_type = config["model_type"]
    qkv_bias = model_type == "qwen2" or config.get("attention_bias", False)
    o_bias = model_type != "qwen2" and config.get("attention_bias", False)

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = normal(hidden, mean=1.0, std=NORM_STD)
        qkv_rows = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
        for name, rows in qkv_rows.items():
            weights[f"{p}self_attn.{name}_proj.weight"] = normal(rows, hidden)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        if qkv_bias:
            for name, rows in qkv_rows.items():
                weights[f"{p}self_attn.{name}_proj.bias"] = normal(rows, std=BIAS_STD)
        if o_bias:
            weights[p + "self_attn.o_proj.bias"] = normal(hidden, std=BIAS_STD)
        if model_type == "qwen3":
            for name in ("q_norm", "k_norm"):
                weights[f"{p}self_attn.{name}.weight"] = normal(head_dim, mean=1.0, std=NORM_STD)
        weights[p + "post_attention_layernorm.weight"] = normal(hidden, mean=1.0, std=NORM_STD)
        weights[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    weights["model.norm.weight"] = FINAL_NORM_SCALE * normal(hidden, mean=1.0, std=NORM_STD)
    if not config.get("tie_word_embeddings", False):
        weights["lm_head.weight"] = normal(config["vocab_size"], hidden)
    return weights


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens; `<s>` prepended on encode."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in byte_chars():
        vocab[char] = len(vocab)
    merges: list[tuple[str, str]] = []
    for left, right in _merge_pairs():
        if len(vocab) >= vocab_size:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    if len(vocab) != vocab_size:
        raise ValueError(f"cannot build a vocab of {vocab_size}: got {len(vocab)} tokens")

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bos = SPECIAL_TOKENS[BOS_ID]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return tokenizer


def _merge_pairs() -> Iterator[tuple[str, str]]:
    """Merges in rank order: tokens by falling probability under the letter model `_P`.

    A token is a word start or a letter followed by letters, merged from its prefix and its
    last letter. A prefix is more probable than its extensions, so it is always in the vocab
    already. Enumerated lazily: popping `prefix + _LETTERS[i]` queues its sibling
    `prefix + _LETTERS[i + 1]` and its first child `prefix + _LETTERS[i] + _LETTERS[0]`.
    """
    heap = [(-_P[s] * _P[_LETTERS[0]], s, 0) for s in _P]
    while heap:
        neg_p, prefix, i = heapq.heappop(heap)
        token = prefix + _LETTERS[i]
        yield prefix, _LETTERS[i]
        if i + 1 < len(_LETTERS):
            sibling_p = neg_p / _P[_LETTERS[i]] * _P[_LETTERS[i + 1]]
            heapq.heappush(heap, (sibling_p, prefix, i + 1))
        heapq.heappush(heap, (neg_p * _P[_LETTERS[0]], token, 0))


def _write_weights(path: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(weights, str(path / "model.safetensors"), metadata=metadata)
        return
    names = list(weights)
    if shards > len(names):
        raise ValueError(f"cannot split {len(names)} tensors into {shards} shards")
    weight_map: dict[str, str] = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k * len(names) // shards : (k + 1) * len(names) // shards]
        save_file({n: weights[n] for n in part}, str(path / file), metadata=metadata)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(
        path / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
