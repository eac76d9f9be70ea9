"""Random-weight checkpoints: HF format, tokenizer, chat template, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from gpu_worker.model_init import build_config, build_tokenizer, write_random_checkpoint

transformers = pytest.importorskip("transformers")

MICRO = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
}
TOKENIZER = build_tokenizer(1024)


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("micro"), overrides=MICRO)


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_same_seed_writes_identical_bytes(tmp_path: Path) -> None:
    for name in ("a", "b"):
        write_random_checkpoint(tmp_path / name, arch="qwen3", seed=5, overrides=MICRO, shards=2)
    first, second = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert set(first) == {
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert first == second
    write_random_checkpoint(tmp_path / "c", arch="qwen3", seed=6, overrides=MICRO, shards=2)
    other = _files(tmp_path / "c")
    assert other["model-00001-of-00002.safetensors"] != first["model-00001-of-00002.safetensors"]


def test_shard_index_covers_every_tensor(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path, overrides=MICRO, shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = {f.name for f in path.glob("*.safetensors")}
    assert set(index["weight_map"].values()) == files
    assert len(index["weight_map"]) == 2 + 9 * MICRO["num_hidden_layers"] + 1
    total = sum((path / f).stat().st_size for f in files)
    assert 0 < index["metadata"]["total_size"] < total


def test_configs_follow_each_architecture() -> None:
    llama = build_config("tiny", "llama")
    assert (llama["hidden_size"], llama["num_hidden_layers"], llama["vocab_size"]) == (256, 4, 4096)
    assert (llama["num_attention_heads"], llama["num_key_value_heads"]) == (8, 4)
    assert llama["head_dim"] == 32 and llama["max_position_embeddings"] == 2048
    small = build_config("small", "mistral")
    assert (small["hidden_size"], small["num_key_value_heads"], small["vocab_size"]) == (
        768,
        4,
        32000,
    )
    assert small["sliding_window"] is None
    qwen2 = build_config("tiny", "qwen2")
    assert qwen2["num_key_value_heads"] == qwen2["num_attention_heads"]  # MHA by default
    assert "attention_bias" not in qwen2 and "head_dim" not in qwen2
    qwen3 = build_config("tiny", "qwen3", {"hidden_size": 128})
    assert qwen3["head_dim"] == 32 != qwen3["hidden_size"] // qwen3["num_attention_heads"]
    classic = build_config("tiny", "llama", {"rope_theta": 1e6})
    assert "rope_parameters" not in classic and classic["rope_theta"] == 1e6
    with pytest.raises(ValueError, match="unknown arch"):
        build_config("tiny", "gpt2")


def test_transformers_loads_the_config(micro_dir: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(micro_dir)
    assert config.model_type == "llama" and config.hidden_size == 64
    assert config.rope_parameters["rope_theta"] == 10000.0


def test_tokenizer_loads_in_tokenizers_and_transformers(micro_dir: Path) -> None:
    raw = Tokenizer.from_file(str(micro_dir / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(micro_dir)
    assert raw.get_vocab_size() == len(hf) == MICRO["vocab_size"]
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    text = "Hello, wörld — the cat sat.\n"
    ids = raw.encode(text).ids
    assert ids[0] == 1 and ids.count(1) == 1  # <s> prepended once
    assert hf(text)["input_ids"] == ids
    assert hf.decode(ids, skip_special_tokens=True) == raw.decode(ids) == text


def test_every_id_decodes() -> None:
    for token_id in range(TOKENIZER.get_vocab_size()):
        text = TOKENIZER.decode([token_id], skip_special_tokens=False)
        assert text or token_id < 3
    assert TOKENIZER.get_vocab_size(with_added_tokens=True) == 1024


def test_merges_shorten_english_text() -> None:
    text = "the rain in spain stays mainly in the plain"
    assert len(TOKENIZER.encode(text, add_special_tokens=False).ids) < 0.6 * len(text)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_encode_decode_round_trips_any_text(text: str) -> None:
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    assert TOKENIZER.decode(ids, skip_special_tokens=False) == text


def test_chat_template_renders_in_transformers(micro_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(micro_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi!</s>\n<|assistant|>\n"
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"]
    assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 2
    assert tokenizer.decode(ids) == text


def test_small_vocab_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 259"):
        write_random_checkpoint(tmp_path, overrides={**MICRO, "vocab_size": 200})
