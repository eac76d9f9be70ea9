"""Load a checkpoint into a `CausalLM`: HF safetensors (one file or sharded) or GGUF."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from gpu_worker.models.base import TensorParallel
from gpu_worker.models.config import ModelConfig, UnsupportedModelError
from gpu_worker.models.llama import CausalLM
from pagedserve.gguf import GGUFCheckpoint, GGUFError, find_gguf, open_gguf

INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES_SHOWN = 5


class CheckpointError(ValueError):
    """The checkpoint directory is incomplete or does not match its config."""


def load_model(
    model_path: str | Path,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    tp: TensorParallel | None = None,
) -> CausalLM:
    """Build the model at `model_path` and fill it from its weights.

    `model_path` is an HF checkpoint directory (config.json + safetensors) or a GGUF file (or a
    directory holding one), whose tensors are dequantized at load. Tensors are cast to `dtype`
    and placed on `device`. Tensors the model does not use are ignored; a missing one raises
    `CheckpointError` naming it. With `tp`, the shard of one tensor-parallel rank: from
    safetensors only its slices are read.
    """
    path = Path(model_path)
    gguf = _gguf(path)
    if gguf is not None:
        ckpt, config = gguf
        get = ckpt.tensor if tp is None else lambda n: tp.shard.slice(n, ckpt.tensor(n))
        return _fill(path, config, set(ckpt.tensor_names()), get, dtype, device, tp)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: not an HF checkpoint directory")
    try:
        config = ModelConfig.from_dir(path)
    except UnsupportedModelError:
        raise
    except ValueError as exc:  # a malformed config.json (JSON errors included)
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from exc
    files = safetensors_files(path)
    with ExitStack() as stack:
        handles: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            handles.update(dict.fromkeys(handle.keys(), handle))
        if tp is None:
            get = lambda n: handles[n].get_tensor(n)  # noqa: E731
        else:
            get = lambda n: tp.shard.slice(n, handles[n].get_slice(n))  # noqa: E731
        return _fill(path, config, set(handles), get, dtype, device, tp)


def load_config(model_path: str | Path) -> ModelConfig:
    """The `ModelConfig` of an HF checkpoint directory or a GGUF file."""
    gguf = _gguf(Path(model_path))
    return gguf[1] if gguf is not None else ModelConfig.from_dir(model_path)


def _gguf(path: Path) -> tuple[GGUFCheckpoint, ModelConfig] | None:
    """The GGUF checkpoint at `path` and its config; None when `path` is not a GGUF."""
    try:
        gguf_file = find_gguf(path)
        if gguf_file is None:
            return None
        ckpt = open_gguf(gguf_file)
        return ckpt, ModelConfig.from_dict(ckpt.hf_config(), ckpt.generation_config())
    except GGUFError as exc:
        raise CheckpointError(str(exc)) from exc


def _fill(
    path: Path,
    config: ModelConfig,
    available: set[str],
    get: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    device: str | torch.device,
    tp: TensorParallel | None = None,
) -> CausalLM:
    model = CausalLM(config, dtype=dtype, device=device, tp=tp)
    missing = [name for name in model.checkpoint_tensor_names() if name not in available]
    if missing:
        shown = ", ".join(missing[:_MAX_NAMES_SHOWN])
        hidden = len(missing) - _MAX_NAMES_SHOWN
        more = f" and {hidden} more" if hidden > 0 else ""
        raise CheckpointError(
            f"checkpoint {path} is missing {len(missing)} tensor(s): {shown}{more}"
        )
    try:
        model.load_weights(get)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    return model.eval()


def size_on_disk(model_path: str | Path) -> int:
    """Bytes of a checkpoint: its file, or the files directly in its directory."""
    path = Path(model_path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def model_name(model_path: str | Path) -> str:
    """The name a model is served under by default: its directory's, or its GGUF file's stem."""
    path = Path(model_path).resolve()
    return path.stem if path.is_file() and path.suffix == ".gguf" else path.name


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: those the shard index names, else `*.safetensors`."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index_path} names shard files that do not exist: {absent}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files
