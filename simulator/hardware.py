"""What the cost model knows about devices and models: a table of GPUs (spec-sheet peaks) and
the shapes of named models, or of any Hugging Face config.json.

Peaks are the vendors' dense bf16 tensor-core FLOP/s and HBM bandwidth; what a kernel achieves
of them is a fraction the device profile sets (`cost.DeviceProfile`). Interconnect figures are
one direction of one GPU's links, which is what a ring all-reduce moves data over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

GB = 1e9
GIB = 1 << 30


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float  # dense peak, FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory_bytes: int
    link_bandwidth: float  # NVLink (or PCIe where there is none) per direction, bytes/s
    host_bandwidth: float  # PCIe to host memory (swap), bytes/s


GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        # H100 SXM5: 989 TFLOP/s bf16 dense, HBM3 3.35 TB/s, 80 GB, NVLink 4 900 GB/s both ways.
        Gpu("H100", 989e12, 3.35e12, 80 * GIB, 450 * GB, 64 * GB),
        # H200 SXM: the H100's compute with HBM3e 4.8 TB/s, 141 GB.
        Gpu("H200", 989e12, 4.8e12, int(141 * GB), 450 * GB, 64 * GB),
        # A100 SXM4: 312 TFLOP/s bf16, NVLink 3 600 GB/s both ways, PCIe 4.
        Gpu("A100-80GB", 312e12, 2.039e12, 80 * GIB, 300 * GB, 32 * GB),
        Gpu("A100-40GB", 312e12, 1.555e12, 40 * GIB, 300 * GB, 32 * GB),
        # L4: 121 TFLOP/s bf16 dense, GDDR6 300 GB/s, 24 GB, no NVLink (PCIe 4 x16).
        Gpu("L4", 121e12, 300 * GB, 24 * GIB, 32 * GB, 32 * GB),
    )
}
GPU_ALIASES = {"H100-SXM": "H100", "A100": "A100-80GB", "A100-80G": "A100-80GB"}


@dataclass(frozen=True)
class ModelShape:
    """The shape that decides a step's cost. The MLP is gated (SwiGLU, three matrices) for
    Llama-family models and plain (two) for OPT."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    gated_mlp: bool = True
    tied_embeddings: bool = False
    dtype_bytes: int = 2

    @property
    def layer_params(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attn = h * q + 2 * h * kv + q * h
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        return attn + mlp

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params + embed * (1 if self.tied_embeddings else 2)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers (the whole model, before any TP split)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, path: Path, name: str | None = None) -> ModelShape:
        """A config.json (or its directory) of a Llama-family or OPT checkpoint."""
        path = path / "config.json" if path.is_dir() else path
        c = json.loads(path.read_text())
        if c.get("model_type") == "opt":
            hidden = c["hidden_size"]
            heads = c["num_attention_heads"]
            return cls(
                name or c.get("_name_or_path") or path.parent.name,
                c["num_hidden_layers"],
                hidden,
                heads,
                heads,
                hidden // heads,
                c["ffn_dim"],
                c["vocab_size"],
                c.get("max_position_embeddings", 2048),
                gated_mlp=False,
                tied_embeddings=True,
            )
        hidden = c["hidden_size"]
        heads = c["num_attention_heads"]
        return cls(
            name or path.parent.name,
            c["num_hidden_layers"],
            hidden,
            heads,
            c.get("num_key_value_heads") or heads,
            c.get("head_dim") or hidden // heads,
            c["intermediate_size"],
            c["vocab_size"],
            c.get("max_position_embeddings", 4096),
            tied_embeddings=bool(c.get("tie_word_embeddings", False)),
            dtype_bytes=4 if c.get("torch_dtype") == "float32" else 2,
        )


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8192),
        ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 8192),
        ModelShape("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936, 40960),
        # OPT-13B as the PagedAttention paper served it: MHA, plain MLP, 2,048 positions.
        ModelShape(
            "opt-13b",
            40,
            5120,
            40,
            40,
            128,
            20480,
            50272,
            2048,
            gated_mlp=False,
            tied_embeddings=True,
        ),
        # The default model of `pagedserve up`, for the CPU profile.
        ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, 8192, tied_embeddings=True),
    )
}


def resolve_gpu(name: str) -> Gpu:
    key = GPU_ALIASES.get(name, name)
    for gpu_name, gpu in GPUS.items():
        if gpu_name.lower() == key.lower():
            return gpu
    raise ValueError(f"unknown GPU {name!r}: one of {', '.join(GPUS)}")


def resolve_model(name: str, dtype_bytes: int | None = None) -> ModelShape:
    """A named shape, or a path to a config.json or a checkpoint directory."""
    shape = MODELS.get(name.lower())
    if shape is None:
        path = Path(name)
        if not path.exists():
            raise ValueError(
                f"unknown model {name!r}: one of {', '.join(MODELS)}, or a config.json"
            )
        shape = ModelShape.from_hf_config(path)
    return shape if dtype_bytes is None else replace(shape, dtype_bytes=dtype_bytes)
