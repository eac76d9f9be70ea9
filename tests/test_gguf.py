"""GGUF checkpoints on small random models: dequantization and layout against transformers'
own GGUF reader, serving a GGUF through real processes, conversion, and bad files."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file

from control_plane.tokenizer import load_tokenizer
from gpu_worker.checkpoint import CheckpointError, load_model
from pagedserve.gguf import GGUFError, convert_gguf, find_gguf, open_gguf
from protos.v1 import control_plane_pb2 as pb
from tests.gguf_files import Q, write_gguf
from tests.oracle import hf_greedy
from tests.procs import free_port
from tests.stack import greedy_to_length, start_stack

transformers = pytest.importorskip("transformers")

# Rows of 256 so that every quantization type (K-quants: 256-element super-blocks) fits.
GGUF_SHAPE = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 512,
}


@pytest.fixture(scope="module")
def gguf_model(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    """gguf_model(arch, types=...) -> (hf_dir, gguf_path), cached per module."""
    cache: dict[tuple[str, object], tuple[Path, Path]] = {}

    def make(arch: str = "llama", types: object = None) -> tuple[Path, Path]:
        key = (arch, types)
        if key not in cache:
            hf_dir = make_checkpoint(arch, **GGUF_SHAPE)
            out = tmp_path_factory.mktemp(f"gguf-{arch}") / "model.gguf"
            kwargs = {} if types is None else {"types": types}
            cache[key] = (hf_dir, write_gguf(hf_dir, out, **kwargs))  # type: ignore[arg-type]
        return cache[key]

    return make


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tensors_equal_transformers_own_gguf_reading(gguf_model, arch: str) -> None:
    """Every tensor, dequantized from F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K and Q6_K
    and (llama) un-permuted, is bit for bit what transformers reads from the same file."""
    _, path = gguf_model(arch)
    ckpt = open_gguf(path)
    kinds = {t.tensor_type.name for t in ckpt.reader.tensors}
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"} <= kinds
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    theirs = hf.state_dict()
    for name in ckpt.tensor_names():
        assert torch.equal(ckpt.tensor(name), theirs[name]), name
    assert type(hf).__name__ == ckpt.hf_config()["architectures"][0]


def test_q_and_k_rows_come_back_in_hf_order(gguf_model) -> None:
    """Against the original weights (not transformers): llama.cpp's Q/K row permutation is
    undone, so a Q8_0 round trip lands within quantization error of every HF row."""
    hf_dir, path = gguf_model(
        "llama", types=lambda name, shape: Q.Q8_0 if len(shape) == 2 else Q.F32
    )
    ckpt = open_gguf(path)
    original = load_file(str(hf_dir / "model.safetensors"))
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        got, want = ckpt.tensor(name), original[name]
        scale = want.abs().max()
        assert (got - want).abs().max() < scale / 100, name
        shuffled = want[torch.randperm(want.shape[0], generator=torch.Generator().manual_seed(0))]
        assert (got - shuffled).abs().max() > scale / 10  # the check can tell rows apart


def test_config_from_metadata(gguf_model) -> None:
    _, path = gguf_model("qwen3")
    config = open_gguf(path).hf_config()
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 128  # Qwen3's explicit head_dim, not hidden / heads
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["tie_word_embeddings"] is False
    model = load_model(path, torch.float32)
    assert model.config.qk_norm and model.config.head_dim == 128


def test_a_gguf_is_served_through_real_processes(gguf_model, spawn) -> None:
    """The worker loads the GGUF itself and the control plane builds its tokenizer from the
    same file: greedy tokens equal transformers' on that file, text prompts tokenize alike."""
    _, path = gguf_model("llama")
    stack = start_stack(spawn, path, dtype="float64")
    prompts = [[5, 17, 300, 42], [100, 200, 300, 400, 7, 8, 9] * 3]
    expected = hf_greedy(path.parent, prompts, [12, 12], gguf_file=path.name)
    assert [greedy_to_length(stack.stub, p, 12) for p in prompts] == expected
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    req = pb.GenerateRequest(text="the cat sat", add_special_tokens=True)
    req.sampling.max_tokens = 1
    last = list(stack.stub.Generate(req, timeout=60))[-1]
    expected_ids = tok("the cat sat")["input_ids"]
    assert expected_ids[0] == 1  # <s>: the file says add_bos_token
    assert load_tokenizer(path).encode("the cat sat", True) == expected_ids
    assert last.prompt_tokens == len(expected_ids)
    models = stack.stub.ListModels(pb.ListModelsRequest()).models
    assert [m.id for m in models] == ["model"]  # the GGUF file's stem


def test_convert_writes_a_directory_transformers_loads(gguf_model, tmp_path: Path) -> None:
    _, path = gguf_model("qwen2")
    out = convert_gguf(path, tmp_path / "converted")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    converted = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    direct = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    ours, theirs = converted.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids = torch.tensor([[5, 6, 7, 300, 11]])
    a = converted.generate(ids, max_new_tokens=8, do_sample=False)
    b = direct.generate(ids, max_new_tokens=8, do_sample=False)
    assert a.tolist() == b.tolist()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "</s>" and tok.bos_token == "<s>"
    assert "<|assistant|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    with pytest.raises(FileExistsError):
        convert_gguf(path, out)


def test_the_tokenizer_round_trips_through_gguf(gguf_model) -> None:
    """The GGUF holds the source checkpoint's vocabulary and merges: our tokenizer built from
    it encodes and decodes exactly as the source's tokenizer.json does."""
    from tokenizers import Tokenizer

    hf_dir, path = gguf_model("llama")
    source = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    ours = open_gguf(path).tokenizer()
    text = "the quick brown fox, 12 jumps!\n\n  over <s> the lazy dog </s> naïve café 🙂"
    for special in (False, True):
        assert (
            ours.encode(text, add_special_tokens=special).ids
            == source.encode(text, add_special_tokens=special).ids
        )
    ids = source.encode(text).ids
    assert ours.decode(ids, skip_special_tokens=True) == source.decode(ids)


# -- bad files ----------------------------------------------------------------------------------


def _write_minimal(
    path: Path,
    arch: str,
    tensor_type: object = None,
    pre: str | None = "gpt2",
    extra: str = "",
    meta: dict[str, object] | None = None,
    vocab: Callable[[GGUFWriter], int] | None = None,
) -> Path:
    """A small GGUF with one embedding tensor (optionally raw bytes of `tensor_type`), a
    float32 tensor named `extra` when given, and `meta` (arch-relative keys) over the rest.
    `vocab` writes the tokenizer and returns its size (default: three byte-level tokens with
    the pre-tokenizer `pre`)."""
    w = GGUFWriter(str(path), arch)
    fields: dict[str, object] = {
        "block_count": 1,
        "embedding_length": 32,
        "feed_forward_length": 64,
        "attention.head_count": 4,
        **(meta or {}),
    }
    for key, value in fields.items():
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        elif isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)  # type: ignore[arg-type]
    if vocab is None:
        w.add_tokenizer_model("gpt2")
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(["a", "b", "ab"])
        w.add_token_merges(["a b"])
        num_tokens = 3
    else:
        num_tokens = vocab(w)
    if tensor_type is None:
        w.add_tensor("token_embd.weight", np.zeros((num_tokens, 32), dtype=np.float32))
    else:
        raw = np.zeros((num_tokens, 18), dtype=np.uint8)  # one 32-element block per row
        w.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=tensor_type)
    if extra:
        w.add_tensor(extra, np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_files_fail_with_a_clear_error(gguf_model, tmp_path: Path) -> None:
    _, good = gguf_model("llama")
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        open_gguf(truncated)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        open_gguf(header_only)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        open_gguf(garbage)
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'falcon'"):
        open_gguf(_write_minimal(tmp_path / "falcon.gguf", "falcon"))
    with pytest.raises(GGUFError, match="token_embd.weight is stored as IQ4_NL"):
        open_gguf(_write_minimal(tmp_path / "iq.gguf", "llama", Q.IQ4_NL))
    with pytest.raises(GGUFError, match="rope_freqs.weight .* is not supported"):
        open_gguf(_write_minimal(tmp_path / "rope.gguf", "llama", extra="rope_freqs.weight"))
    with pytest.raises(GGUFError, match="unsupported pre-tokenizer 'chatglm-bpe'"):
        open_gguf(_write_minimal(tmp_path / "pre.gguf", "llama", pre="chatglm-bpe"))
    with pytest.raises(CheckpointError, match="missing 10 tensor.*input_layernorm"):
        load_model(_write_minimal(tmp_path / "few.gguf", "llama"), torch.float32)
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="several GGUF files"):
        find_gguf(two)


def test_metadata_is_checked_when_the_file_is_opened(tmp_path: Path) -> None:
    """Everything the config needs is checked by open_gguf (so before any port opens)."""

    def opened(name: str, **kw: object) -> object:
        return open_gguf(_write_minimal(tmp_path / f"{name}.gguf", "llama", **kw))  # type: ignore[arg-type]

    # Per-layer head counts, all alike, are one count.
    ckpt = opened("per-layer", meta={"attention.head_count_kv": [2]})
    assert ckpt.hf_config()["num_key_value_heads"] == 2  # type: ignore[attr-defined]
    with pytest.raises(GGUFError, match="head_count_kv must be a positive integer"):
        opened("mixed", meta={"block_count": 2, "attention.head_count_kv": [2, 4]})
    with pytest.raises(GGUFError, match="head_count must be a positive integer, got 0"):
        opened("zero", meta={"attention.head_count": 0})
    with pytest.raises(GGUFError, match="unsupported RoPE scaling 'yarn'"):
        opened("yarn", meta={"rope.scaling.type": "yarn"})
    with pytest.raises(GGUFError, match="unsupported pre-tokenizer 'default'"):
        opened("no-pre", pre=None)


def test_a_bad_gguf_stops_the_worker_before_it_listens(tmp_path: Path) -> None:
    bad = _write_minimal(tmp_path / "falcon.gguf", "falcon")
    port = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedserve.cli",
            "worker",
            "--model",
            str(bad),
            "--port",
            str(port),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "unsupported GGUF architecture 'falcon'" in proc.stderr


def test_convert_leaves_nothing_behind_on_a_bad_file(tmp_path: Path) -> None:
    bad = _write_minimal(tmp_path / "iq.gguf", "llama", Q.IQ4_NL)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedserve.cli",
            "model",
            "convert",
            str(bad),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "IQ4_NL" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iq.gguf"]


def test_convert_is_atomic(gguf_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversion that fails midway (here: the disk fills while writing weights) leaves
    neither the target nor a temporary directory."""
    import safetensors.torch

    _, path = gguf_model("llama")

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        convert_gguf(path, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# -- SentencePiece vocabularies (Llama 2, Mistral 7B GGUFs) ---------------------------------------

_SPM_PIECES = (
    [f"{chr(0x2581)}{w}" for w in ("the", "th", "a", "of", "an", "and", "in", "to", "o", "t")]
    + ["th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ing", "ion", "es", "or"]
    + [chr(0x2581)]
    + list("abcdefghijklmnopqrstuvwxyz.,!?'")
)


def _sentencepiece_vocab(w: GGUFWriter) -> int:
    """SentencePiece BPE without merges: pieces ranked by score, byte tokens for everything
    else, as llama.cpp writes Llama 2's vocabulary."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *_SPM_PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(_SPM_PIECES)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(_SPM_PIECES))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_space_prefix(True)
    return len(tokens)


def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_does(tmp_path: Path) -> None:
    path = _write_minimal(tmp_path / "spm.gguf", "llama", vocab=_sentencepiece_vocab)
    ours = open_gguf(path).tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = [
        "the theory of things, and the other one.",
        "Hello World! naïve ünïcödé 🙂 123  two  spaces",
        " leading space and trailing ",
        "in</s>between <s> specials",
    ]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ids[0] == 1  # BOS: SentencePiece vocabularies add it by default
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
    ids = ours.encode("the theory").ids
    assert [ours.id_to_token(i) for i in ids] == ["<s>", "▁the", "▁the", "or", "y"]
    assert ours.decode(ours.encode("naïve 🙂").ids, skip_special_tokens=True) == "naïve 🙂"
