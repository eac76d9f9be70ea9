"""The decoder against transformers, on random-weight checkpoints of every supported layout."""

from __future__ import annotations

import types
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from gpu_worker.checkpoint import load_model
from gpu_worker.model_init import write_random_checkpoint
from gpu_worker.models import AttentionFn, CausalLM
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.rope import inv_frequencies

transformers = pytest.importorskip("transformers")

MICRO = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short enough that this micro model's wavelengths land in all three llama3 bands.
    "original_max_position_embeddings": 64,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", {}),
    "llama-gqa-tied": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "mistral-tied": ("mistral", {"tie_word_embeddings": True}),
    "qwen2-mha-bias": ("qwen2", {"num_key_value_heads": 4}),
    "qwen2-mha-bias-tied": ("qwen2", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "qwen3-qknorm": ("qwen3", {"head_dim": 24}),
    "qwen3-qknorm-tied": ("qwen3", {"head_dim": 24, "tie_word_embeddings": True}),
    "llama-llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope-classic-keys": (
        "llama",
        {"rope_theta": 5000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
    ),
}
PROMPT_LEN = 40


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over one contiguous sequence: q, k, v `[T, heads, D]`."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * q.shape[-1] ** -0.5
    future = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(k.shape[0] - q.shape[0] + 1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def segmented_attention(lengths: Sequence[int]) -> AttentionFn:
    """Attention for a flattened batch of whole sequences laid out back to back."""

    def attn(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
        parts = [causal_attention(q[a:b], k[a:b], v[a:b]) for a, b in pairwise(bounds)]
        return torch.cat(parts)

    return attn


def our_logits(model: CausalLM, seqs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Logits for every position of each sequence, all run as one flattened batch."""
    ids = torch.cat(list(seqs))
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        hidden = model(ids, positions, segmented_attention([len(s) for s in seqs]))
        return list(model.compute_logits(hidden).split([len(s) for s in seqs]))


def _rms_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    dtype = torch.promote_types(x.dtype, torch.float32)
    h = x.to(dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(x.dtype)


def hf_logits(path: Path, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    # transformers' RMSNorm computes in float32 even in a float64 model (an upcast meant for
    # half types); compute in the model dtype so float64 comparisons can be tight. For
    # float32 this is the same computation.
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_forward, module)
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return write_random_checkpoint(path, arch=arch, seed=7, overrides={**MICRO, **overrides})


def _prompt(vocab_size: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_logits_match_transformers(checkpoint: Path, dtype: torch.dtype, atol: float) -> None:
    model = load_model(checkpoint, dtype)
    ids = _prompt(model.config.vocab_size, PROMPT_LEN, seed=1)
    (ours,) = our_logits(model, [ids])
    expected = hf_logits(checkpoint, dtype, ids)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, expected, atol=atol, rtol=0)


def test_flattened_batch_matches_single_sequences(checkpoint: Path) -> None:
    model = load_model(checkpoint, torch.float64)
    seqs = [_prompt(model.config.vocab_size, n, seed=n) for n in (13, 29, 1)]
    batched = our_logits(model, seqs)
    for seq, logits in zip(seqs, batched, strict=True):
        torch.testing.assert_close(logits, our_logits(model, [seq])[0], atol=1e-12, rtol=0)


def test_incremental_decode_with_kv_cache_matches_full_prompt(checkpoint: Path) -> None:
    model = load_model(checkpoint, torch.float64)
    ids = _prompt(model.config.vocab_size, 24, seed=3)
    (full,) = our_logits(model, [ids])
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cached_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        past_k, past_v = cache.get(layer, (k[:0], v[:0]))
        cache[layer] = (torch.cat([past_k, k]), torch.cat([past_v, v]))
        return causal_attention(q, *cache[layer])

    steps = [(0, 17), *((i, i + 1) for i in range(17, 24))]  # a prefill, then one token each
    with torch.no_grad():
        for start, end in steps:
            hidden = model(ids[start:end], torch.arange(start, end), cached_attention)
            logits = model.compute_logits(hidden)
            torch.testing.assert_close(logits, full[start:end], atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "rope_scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, {**LLAMA3_ROPE, "factor": 32.0}],
)
def test_inverse_frequencies_are_bit_identical_to_transformers(
    rope_scaling: dict[str, Any] | None,
) -> None:
    rope_params = {"rope_theta": 500000.0, "rope_type": "default", **(rope_scaling or {})}
    hf_config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, rope_parameters=dict(rope_params)
    )
    rope_type = rope_params["rope_type"]
    if rope_type == "default":
        init = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding
        expected, _ = init.compute_default_rope_parameters(hf_config)
    else:
        init_fns = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS
        expected, _ = init_fns[rope_type](hf_config)
    scaling = None if rope_type == "default" else rope_params
    theta = rope_params["rope_theta"]
    assert torch.equal(inv_frequencies(128, theta, scaling), expected)


def test_greedy_output_is_diverse_with_decisive_argmaxes(tmp_path: Path) -> None:
    """The random init keeps exactness tests meaningful: no loops, no near-tied top-2."""
    path = write_random_checkpoint(tmp_path, overrides=MICRO)
    model = load_model(path, torch.float64)
    gaps: list[float] = []
    tokens: list[int] = []
    for seed in range(4):
        ids = _prompt(model.config.vocab_size, 8, seed=seed)
        for _ in range(24):
            logits = our_logits(model, [ids])[0][-1]
            top = logits.topk(2).values
            gaps.append(float(top[0] - top[1]))
            ids = torch.cat([ids, logits.argmax().view(1)])
        tokens += ids[8:].tolist()
    assert len(set(tokens)) > 0.5 * len(tokens)
    assert sorted(gaps)[len(gaps) // 2] > 0.1


def test_load_reads_exactly_the_listed_tensors(checkpoint: Path) -> None:
    tensors = load_file(checkpoint / "model.safetensors")
    model = load_model(checkpoint, torch.float64)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    read: list[str] = []

    def recording_source(name: str) -> torch.Tensor:
        read.append(name)
        return tensors[name]

    model.load_weights(recording_source)
    assert sorted(read) == sorted(model.checkpoint_tensor_names())
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())


def test_config_of_generated_checkpoint(checkpoint: Path) -> None:
    config = ModelConfig.from_dir(checkpoint)
    hf = transformers.AutoConfig.from_pretrained(checkpoint)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert config.head_dim == head_dim
    assert config.num_key_value_heads == hf.num_key_value_heads
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.eos_token_ids == (2,)
    assert config.max_model_len == hf.max_position_embeddings


def test_warm_up_builds_every_prepacked_projection_once_per_row_count(micro_llama: Path) -> None:
    model = load_model(micro_llama, dtype=torch.float32)
    packed = model.layers[0].qkv_packed is not None
    # qkv, o, gate_up, down and the LM head, for 1..8 rows; nothing without oneDNN packing.
    assert model.warm_up(8) == (5 * 8 if packed else 0)
    assert load_model(micro_llama, dtype=torch.float64).warm_up(8) == 0
