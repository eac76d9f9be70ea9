"""Load an HF safetensors checkpoint (single file or sharded) into a `CausalLM`."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from gpu_worker.models.config import ModelConfig
from gpu_worker.models.llama import CausalLM

INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES_SHOWN = 5


class CheckpointError(ValueError):
    """The checkpoint directory is incomplete or does not match its config."""


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> CausalLM:
    """Build the model described by `model_dir/config.json` and fill it from its safetensors.

    Tensors are cast to `dtype` and placed on `device`. Tensors the model does not use are
    ignored; a missing one raises `CheckpointError` naming it.
    """
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: not an HF checkpoint directory")
    config = ModelConfig.from_dir(path)
    files = safetensors_files(path)
    model = CausalLM(config, dtype=dtype, device=device)
    with ExitStack() as stack:
        handles: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            handles.update(dict.fromkeys(handle.keys(), handle))
        missing = [name for name in model.checkpoint_tensor_names() if name not in handles]
        if missing:
            shown = ", ".join(missing[:_MAX_NAMES_SHOWN])
            hidden = len(missing) - _MAX_NAMES_SHOWN
            more = f" and {hidden} more" if hidden > 0 else ""
            raise CheckpointError(
                f"checkpoint {path} is missing {len(missing)} tensor(s): {shown}{more}"
            )
        try:
            model.load_weights(lambda name: handles[name].get_tensor(name))
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    return model.eval()


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
