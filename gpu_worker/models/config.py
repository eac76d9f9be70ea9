"""`ModelConfig`: the architecture facts the decoder needs, parsed from an HF checkpoint dir.

Reads both spellings found in the wild: the classic top-level `rope_theta` / `rope_scaling` /
`torch_dtype` and the transformers-5 `rope_parameters` / `dtype`. Defaults for absent keys
follow each architecture's transformers config class, so a checkpoint means the same thing
here as it does there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")

_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# transformers' per-architecture defaults for keys a config.json may omit.
_DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 4096 * 32,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
}
_DEFAULT_ROPE_THETA = 10000.0
_REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)
_ROPE_REQUIRED_PARAMS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model (or a feature of one) this decoder does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only model.

    `attention_bias` means q/k/v projection biases; `o_proj_bias` the output projection's (set
    together in Llama and Qwen3 when `attention_bias` is true, q/k/v only in Qwen2).
    `rope_scaling` is None for plain RoPE, else a dict with `rope_type` and that type's
    parameters. `sliding_window` is the effective window (None when no layer slides).
    """

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type == "default":
                raise ValueError("rope_scaling must be None for plain (default) RoPE")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"unsupported rope_type {rope_type!r}; "
                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            missing = [k for k in _ROPE_REQUIRED_PARAMS[rope_type] if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope_type {rope_type!r} needs parameters {missing}")
        if any(tok < 0 for tok in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be non-negative, got {self.eos_token_ids}")
        if self.rope_scaling is not None:
            # Frozen means frozen: a read-only copy, so no caller can edit the shared dict.
            object.__setattr__(self, "rope_scaling", MappingProxyType(dict(self.rope_scaling)))

    @property
    def max_model_len(self) -> int:
        """Longest sequence this decoder serves.

        Attention here is full attention, so a sliding window shorter than the position
        table caps the length: beyond it the model would be computing something else.
        """
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def q_size(self) -> int:
        """Width of the query projection, `num_attention_heads * head_dim`."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projections, `num_key_value_heads * head_dim`."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Parse `config.json` (and `generation_config.json` when present) in `model_dir`."""
        path = Path(model_dir)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        config = json.loads(config_path.read_text())
        gen_path = path / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        return cls.from_dict(config, generation)

    @classmethod
    def from_dict(
        cls, config: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        """Build from the parsed `config.json` (and optional `generation_config.json`)."""
        arch = _architecture(config)
        missing = [k for k in _REQUIRED_KEYS if config.get(k) is None]
        if missing:
            raise ValueError(f"config.json lacks required keys {missing}")
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {config['hidden_act']!r}")
        if config.get("mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=true is not supported")

        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim")
        if head_dim is None and arch == "Qwen3ForCausalLM":
            head_dim = 128  # Qwen3Config's default: Qwen3 never derives it from hidden/heads
        max_positions = int(config.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch]))
        rope_theta, rope_scaling = _rope(config, max_positions)
        qkv_bias = {
            "LlamaForCausalLM": bool(config.get("attention_bias", False)),
            "MistralForCausalLM": False,
            "Qwen2ForCausalLM": True,  # hard-wired in transformers' Qwen2Attention
            "Qwen3ForCausalLM": bool(config.get("attention_bias", False)),
        }[arch]
        source = generation_config if generation_config is not None else config
        bos = source.get("bos_token_id", config.get("bos_token_id"))
        eos = source.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(eos)
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=qkv_bias and arch != "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(config, arch),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            dtype=config.get("dtype") or config.get("torch_dtype"),
        )


def _architecture(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures") or []
    if not archs:
        model_type = config.get("model_type")
        if model_type not in _ARCH_BY_MODEL_TYPE:
            raise UnsupportedModelError(
                f"config.json names no architecture (model_type {model_type!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        return _ARCH_BY_MODEL_TYPE[model_type]
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {', '.join(map(str, archs))}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(archs[0])


def _rope(config: Mapping[str, Any], max_positions: int) -> tuple[float, dict[str, Any] | None]:
    """`(rope_theta, rope_scaling)` with transformers' precedence between the two spellings.

    `rope_scaling` wins over `rope_parameters`; a theta inside the dict wins over the
    top-level `rope_theta`; llama3's `original_max_position_embeddings` defaults to
    `max_position_embeddings`.
    """
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError("per-layer-type rope_parameters are not supported")
    theta = float(params.pop("rope_theta", config.get("rope_theta", _DEFAULT_ROPE_THETA)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", max_positions)
    return theta, {"rope_type": rope_type, **params}


def _sliding_window(config: Mapping[str, Any], arch: str) -> int | None:
    if arch == "MistralForCausalLM":
        window = config.get("sliding_window", 4096)  # MistralConfig's default
        return None if window is None else int(window)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = config.get("sliding_window", 4096)
        if not config.get("use_sliding_window", False) or window is None:
            return None
        # Qwen slides only layers at index >= max_window_layers unless layer_types says so.
        num_layers = int(config["num_hidden_layers"])
        layer_types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
            for i in range(num_layers)
        ]
        return int(window) if "sliding_attention" in layer_types else None
    return None
