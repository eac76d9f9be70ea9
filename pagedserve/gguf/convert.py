"""`pagedserve model convert FILE.gguf DIR`: a GGUF file as a Hugging Face checkpoint directory.

The directory holds config.json, generation_config.json, model.safetensors (float32: every
quantized value of the file is exact in float32), tokenizer.json and tokenizer_config.json
(with the chat template). It is written into a temporary sibling and renamed into place, so a
reader sees no directory or a complete one, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pagedserve.gguf.checkpoint import GGUFCheckpoint, open_gguf


def convert_gguf(source: str | Path | GGUFCheckpoint, out_dir: str | Path) -> Path:
    """Write the HF checkpoint of `source` at `out_dir`, which must not exist yet; return it."""
    ckpt = source if isinstance(source, GGUFCheckpoint) else open_gguf(source)
    target = Path(out_dir)
    if target.exists():
        raise FileExistsError(f"{target} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_hf_files(ckpt, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is meant to be readable
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_hf_files(ckpt: GGUFCheckpoint, out: Path) -> None:
    config = ckpt.hf_config()
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", ckpt.generation_config())
    from safetensors.torch import save_file

    tensors = dict(ckpt.iter_tensors())
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    ckpt.tokenizer().save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", ckpt.tokenizer_config())


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
