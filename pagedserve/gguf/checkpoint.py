"""Open a GGUF file, check it, and read its metadata as Hugging Face configs.

What a file must hold to be served: a llama-family architecture (`general.architecture` one of
`ARCHITECTURES`), the tensors that architecture needs (see `tensors.py`), every tensor in a
type that can be dequantized here, and a tokenizer (`tokenizer.ggml.*`). Anything else fails
in `open_gguf`, before a model is built or a port opened, with a `GGUFError` that names what
is wrong.

    GGUF metadata                        HF config.json
    <arch>.block_count                -> num_hidden_layers
    <arch>.embedding_length           -> hidden_size
    <arch>.feed_forward_length        -> intermediate_size
    <arch>.attention.head_count(_kv)  -> num_attention_heads / num_key_value_heads
    <arch>.attention.key_length       -> head_dim (else hidden / heads)
    <arch>.context_length             -> max_position_embeddings
    <arch>.rope.freq_base             -> rope_theta
    <arch>.attention.layer_norm_rms_epsilon -> rms_norm_eps
    no `output.weight` tensor         -> tie_word_embeddings
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from pagedserve.gguf import tensors as gt
from pagedserve.gguf.errors import GGUFError
from pagedserve.gguf.tokenizer import GGUFVocab, build_tokenizer, tokenizer_config

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader, ReaderTensor

# general.architecture -> (HF architecture, HF model_type)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
GGUF_MAGIC = b"GGUF"


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `*.gguf` in a directory that is
    not an HF checkpoint (no config.json). None when `path` is not a GGUF checkpoint."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix == ".gguf" or _has_magic(p) else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    files = sorted(p.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise GGUFError(f"{p} holds several GGUF files ({names}); pass one of them as --model")
    return files[0] if files else None


def _has_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """Read and validate the GGUF at `path` (a file, or a directory holding one)."""
    from gguf import GGUFReader

    file = find_gguf(path)
    if file is None:
        raise GGUFError(f"{path} is not a GGUF file")
    try:
        reader = GGUFReader(file)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        raise GGUFError(_unreadable(file)) from exc
    ckpt = GGUFCheckpoint(file, reader)
    ckpt.validate()
    return ckpt


def _unreadable(file: Path) -> str:
    """Why the gguf reader gave up on `file`, in the file's terms: numpy's own words ("index 0
    is out of bounds for axis 0 with size 0") say nothing about a GGUF."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if not head:
        return f"{file} is empty: not a GGUF file (a download that did not finish?)"
    if not GGUF_MAGIC.startswith(head):  # a few bytes of the magic are a truncated file too
        return f"{file} is not a GGUF file: it does not start with the bytes {GGUF_MAGIC!r}"
    return (
        f"{file} is truncated or corrupt: its {size:,} byte(s) do not read as a GGUF file's "
        "header, metadata, tensor table and tensor data (a download that did not finish?)"
    )


@dataclass
class GGUFCheckpoint:
    path: Path
    reader: GGUFReader

    # -- metadata -------------------------------------------------------------------------------

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Every key-value field, as Python values (tokenizer arrays included)."""
        out: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                out[key] = field.contents()
            except (ValueError, IndexError, UnicodeDecodeError) as exc:
                raise GGUFError(
                    f"{self.path} is corrupt: its metadata field {key!r} does not parse"
                ) from exc
        return out

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def gguf_architecture(self) -> str:
        return str(self.get("general.architecture", ""))

    def _arch_key(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.gguf_architecture}.{key}", default)

    def _count(self, key: str, default: int | None = None) -> int:
        """A positive integer field; one given per layer must be the same for every layer."""
        value = self._arch_key(key, default)
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # per-layer, all alike
        name = f"{self.gguf_architecture}.{key}"
        if value is None:
            raise GGUFError(f"{self.path}: metadata lacks {name}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GGUFError(f"{self.path}: {name} must be a positive integer, got {value!r}")
        return value

    def _number(self, key: str, default: float) -> float:
        value = self._arch_key(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            name = f"{self.gguf_architecture}.{key}"
            raise GGUFError(f"{self.path}: {name} must be a positive number, got {value!r}")
        return float(value)

    @cached_property
    def num_heads(self) -> tuple[int, int]:
        """(query heads, key/value heads)."""
        heads = self._count("attention.head_count")
        return heads, self._count("attention.head_count_kv", heads)

    @cached_property
    def raw_tensors(self) -> dict[str, ReaderTensor]:
        """GGUF tensor name -> its entry in the file's tensor table."""
        return {t.name: t for t in self.reader.tensors}

    # -- validation -----------------------------------------------------------------------------

    def validate(self) -> None:
        arch = self.gguf_architecture
        if arch not in ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: unsupported GGUF architecture {arch!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise GGUFError(
                    f"{self.path} is truncated or corrupt: tensor {t.name} runs past the end of "
                    f"the file ({size:,} bytes)"
                )
        gt.check_tensors(self.path, self.reader.tensors)
        self.tokenizer_source  # noqa: B018 -- raises GGUFError for an unsupported tokenizer
        self.hf_config()  # raises GGUFError for shapes or features that cannot be served

    # -- Hugging Face views ---------------------------------------------------------------------

    def hf_config(self) -> dict[str, Any]:
        """The `config.json` an HF checkpoint of this model would have."""
        arch = self.gguf_architecture
        architecture, model_type = ARCHITECTURES[arch]
        hidden = self._count("embedding_length")
        heads, kv_heads = self.num_heads
        head_dim = self._count("attention.key_length", hidden // heads)
        value_dim = self._count("attention.value_length", head_dim)
        if value_dim != head_dim:
            raise GGUFError(f"{self.path}: key length {head_dim} != value length {value_dim}")
        embed = self.raw_tensors["token_embd.weight"]
        vocab = self._count("vocab_size", int(embed.shape[-1]))
        tok = self.tokenizer_source
        config: dict[str, Any] = {
            "architectures": [architecture],
            "model_type": model_type,
            "hidden_size": hidden,
            "num_hidden_layers": self._count("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "intermediate_size": self._count("feed_forward_length"),
            "vocab_size": vocab,
            "max_position_embeddings": self._count("context_length", 2048),
            "rms_norm_eps": self._number("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": self._number("rope.freq_base", 10000.0),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in self.raw_tensors,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "torch_dtype": "float32",
        }
        scaling = self._rope_scaling()
        if scaling is not None:
            config["rope_scaling"] = scaling
        if tok.pad_token_id is not None:
            config["pad_token_id"] = tok.pad_token_id
        bias = "blk.0.attn_q.bias" in self.raw_tensors
        if model_type in ("llama", "qwen3"):
            config["attention_bias"] = bias
        if model_type == "llama":
            config["mlp_bias"] = False
        if model_type == "qwen2" and not bias:
            raise GGUFError(f"{self.path}: a qwen2 model needs q/k/v biases; this file has none")
        window = self._arch_key("attention.sliding_window")
        if model_type == "mistral":
            config["sliding_window"] = None if window is None else int(window)
        if model_type in ("qwen2", "qwen3"):
            config["use_sliding_window"] = False
        return config

    def generation_config(self) -> dict[str, Any]:
        tok = self.tokenizer_source
        eos = tok.eos_token_ids
        out: dict[str, Any] = {
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
        }
        if tok.pad_token_id is not None:
            out["pad_token_id"] = tok.pad_token_id
        return out

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._arch_key("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind != "linear":
            raise GGUFError(f"{self.path}: unsupported RoPE scaling {kind!r} (supported: linear)")
        return {"rope_type": "linear", "factor": self._number("rope.scaling.factor", 0.0)}

    # -- tensors --------------------------------------------------------------------------------

    def tensor(self, hf_name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor under its HF name, dequantized and cast to `dtype` (float32 by default)."""
        raw = self.raw_tensors[gt.gguf_name(hf_name)]
        permuted = self.gguf_architecture in gt.PERMUTED_ARCHITECTURES
        return gt.read_tensor(raw, hf_name, self.num_heads if permuted else None, dtype)

    def tensor_names(self) -> list[str]:
        """HF names of every tensor the file holds."""
        return [gt.hf_name(name) for name in self.raw_tensors]

    def iter_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.tensor_names():
            yield name, self.tensor(name, dtype)

    # -- tokenizer ------------------------------------------------------------------------------

    @cached_property
    def tokenizer_source(self) -> GGUFVocab:
        """The `tokenizer.ggml.*` fields, checked."""
        return GGUFVocab.from_metadata(self.path, self.metadata)

    def tokenizer(self) -> Tokenizer:
        """A tokenizer equivalent to the one the model was trained with."""
        return build_tokenizer(self.tokenizer_source)

    def tokenizer_config(self) -> dict[str, Any]:
        """The `tokenizer_config.json` an HF checkpoint would have (with the chat template)."""
        return tokenizer_config(self.tokenizer_source, self.hf_config()["max_position_embeddings"])
