"""Loading HF checkpoints: file layouts, errors, dtypes, and config parsing in both spellings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.checkpoint import CheckpointError, load_model
from gpu_worker.model_init import write_random_checkpoint
from gpu_worker.models import CausalLM
from gpu_worker.models.config import ModelConfig, UnsupportedModelError

MICRO = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
}
BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    **MICRO,
}


@pytest.fixture
def micro_dir(tmp_path: Path) -> Path:
    return write_random_checkpoint(tmp_path / "micro", overrides=MICRO)


def _state(model: CausalLM) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in model.state_dict().items()}


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    single = write_random_checkpoint(tmp_path / "single", overrides=MICRO, seed=3)
    sharded = write_random_checkpoint(tmp_path / "sharded", overrides=MICRO, seed=3, shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    a, b = _state(load_model(single, torch.float32)), _state(load_model(sharded, torch.float32))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_tensor_is_named(micro_dir: Path) -> None:
    weights = load_file(micro_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, micro_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj"):
        load_model(micro_dir, torch.float32)


def test_many_missing_tensors_are_counted(micro_dir: Path) -> None:
    weights = load_file(micro_dir / "model.safetensors")
    save_file(
        {"model.embed_tokens.weight": weights["model.embed_tokens.weight"]},
        micro_dir / "model.safetensors",
    )
    with pytest.raises(CheckpointError, match=r"missing 20 tensor.*and 15 more"):
        load_model(micro_dir, torch.float32)


def test_extra_tensors_are_ignored(micro_dir: Path) -> None:
    weights = load_file(micro_dir / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, micro_dir / "model.safetensors")
    load_model(micro_dir, torch.float32)


def test_wrong_shape_is_named(micro_dir: Path) -> None:
    weights = load_file(micro_dir / "model.safetensors")
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(weights, micro_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \(64, 64\)"):
        load_model(micro_dir, torch.float32)


def test_missing_config_or_weights_is_a_clear_error(micro_dir: Path) -> None:
    (micro_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(micro_dir, torch.float32)
    (micro_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(micro_dir, torch.float32)


def test_index_naming_an_absent_shard_is_an_error(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path, overrides=MICRO, shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        load_model(path, torch.float32)


def test_unsupported_architecture(micro_dir: Path) -> None:
    _edit_json(micro_dir / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM") as info:
        load_model(micro_dir, torch.float32)
    assert "Qwen3ForCausalLM" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bfloat16_load_runs_close_to_float32(micro_dir: Path) -> None:
    ids = torch.arange(3, 19)
    positions = torch.arange(16)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(micro_dir, dtype)
        assert all(p.dtype == dtype for p in model.parameters())
        with torch.no_grad():
            hidden = model(ids, positions, _full_causal_attention)
            logits[dtype] = model.compute_logits(hidden)
    assert logits[torch.bfloat16].dtype == torch.float32
    error = (logits[torch.bfloat16] - logits[torch.float32]).abs().mean()
    assert error < 0.05 * logits[torch.float32].abs().mean()


def _full_causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    group = q.shape[1] // k.shape[1]
    q, k, v = (
        t.transpose(0, 1) for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    )
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(0, 1)


# --- config parsing -------------------------------------------------------------------------


def test_transformers5_rope_parameters_and_dtype() -> None:
    config = ModelConfig.from_dict(
        {
            **BASE_CONFIG,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "dtype": "bfloat16",
        }
    )
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None
    assert dict(config.rope_scaling) == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config.dtype == "bfloat16"


def test_classic_rope_keys_and_torch_dtype() -> None:
    config = ModelConfig.from_dict(
        {
            **BASE_CONFIG,
            "rope_theta": 1000000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "torch_dtype": "float16",
        }
    )
    assert config.rope_theta == 1000000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.dtype == "float16"

    plain = ModelConfig.from_dict({**BASE_CONFIG, "rope_theta": 20000, "rope_scaling": None})
    assert (plain.rope_theta, plain.rope_scaling) == (20000.0, None)
    assert ModelConfig.from_dict(BASE_CONFIG).rope_theta == 10000.0


def test_llama3_original_length_defaults_to_max_positions() -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1, "high_freq_factor": 4}
    config = ModelConfig.from_dict(
        {**BASE_CONFIG, "max_position_embeddings": 4096, "rope_scaling": rope}
    )
    assert config.rope_scaling is not None
    assert config.rope_scaling["original_max_position_embeddings"] == 4096


def test_unsupported_rope_type() -> None:
    with pytest.raises(UnsupportedModelError, match="'yarn'.*default, linear, llama3"):
        ModelConfig.from_dict({**BASE_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_head_dim_explicit_or_derived() -> None:
    assert ModelConfig.from_dict(BASE_CONFIG).head_dim == 16
    assert ModelConfig.from_dict({**BASE_CONFIG, "head_dim": 32}).head_dim == 32
    qwen3 = {**BASE_CONFIG, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    assert ModelConfig.from_dict(qwen3).head_dim == 128  # Qwen3Config's default
    assert ModelConfig.from_dict(qwen3).qk_norm


def test_qwen2_has_qkv_bias_without_saying_so() -> None:
    qwen2 = ModelConfig.from_dict({**BASE_CONFIG, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.attention_bias and not qwen2.o_proj_bias
    llama = ModelConfig.from_dict({**BASE_CONFIG, "attention_bias": True})
    assert llama.attention_bias and llama.o_proj_bias


def test_sliding_window_caps_max_model_len() -> None:
    mistral = {
        **BASE_CONFIG,
        "architectures": ["MistralForCausalLM"],
        "max_position_embeddings": 32768,
    }
    assert ModelConfig.from_dict({**mistral, "sliding_window": 4096}).max_model_len == 4096
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).max_model_len == 32768
    assert ModelConfig.from_dict({**mistral, "sliding_window": 65536}).max_model_len == 32768
    qwen2 = {**mistral, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_dict(qwen2).sliding_window is None  # use_sliding_window is off
    sliding = {**qwen2, "use_sliding_window": True, "max_window_layers": 1}
    assert ModelConfig.from_dict(sliding).max_model_len == 4096


def test_eos_ids_prefer_generation_config() -> None:
    assert ModelConfig.from_dict({**BASE_CONFIG, "eos_token_id": 2}).eos_token_ids == (2,)
    config = ModelConfig.from_dict(
        {**BASE_CONFIG, "bos_token_id": 1, "eos_token_id": 2},
        {"bos_token_id": 5, "eos_token_id": [7, 8]},
    )
    assert (config.bos_token_id, config.eos_token_ids) == (5, (7, 8))


def test_config_is_frozen_and_validated() -> None:
    config = ModelConfig.from_dict({**BASE_CONFIG, "rope_scaling": {"type": "linear", "factor": 2}})
    with pytest.raises(AttributeError):
        config.hidden_size = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.rope_scaling["factor"] = 3  # type: ignore[index]
    hash(config)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig.from_dict({**BASE_CONFIG, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="lacks required keys.*vocab_size"):
        ModelConfig.from_dict({k: v for k, v in BASE_CONFIG.items() if k != "vocab_size"})
