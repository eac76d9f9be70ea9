"""Loads a checkpoint's tokenizer and its chat and special-token settings: from tokenizer.json
and tokenizer_config.json in an HF directory, or from the metadata of a GGUF file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from pagedserve.gguf import find_gguf, open_gguf
from pagedserve.gguf.tokenizer import special_tokens


@dataclass
class LoadedTokenizer:
    tokenizer: Tokenizer
    bos_token_id: int | None
    chat_template: str | None
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the chat template sees them

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text; add_special_tokens applies the tokenizer's own post-processor
        (BOS for Llama-style tokenizers). Runs without the GIL (`encode` would hold it for the
        whole text, `encode_batch` releases it), so a long prompt tokenized on a thread stalls
        no other Python thread."""
        batch = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = batch[0].ids
        return ids

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its vocabulary entry is at
        least as long (byte-level entries spell one character per byte, SentencePiece pieces
        one per character, byte-fallback tokens `<0xNN>` six for one byte). A text longer than
        this times a context length can never fit it, whatever it holds."""
        return max(len(piece) for piece in self.tokenizer.get_vocab(with_added_tokens=True))


def load_tokenizer(model_path: str | Path) -> LoadedTokenizer:
    gguf_file = find_gguf(model_path)
    if gguf_file is not None:
        return _gguf_tokenizer(gguf_file)
    d = Path(model_path)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the checkpoint has no tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    cfg: dict[str, object] = {}
    if (d / "tokenizer_config.json").is_file():
        cfg = json.loads((d / "tokenizer_config.json").read_text())
    special: dict[str, str] = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
    bos = special.get("bos_token")
    bos_id = tok.token_to_id(bos) if bos is not None else None
    template = cfg.get("chat_template")
    if not isinstance(template, str) and (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    return LoadedTokenizer(tok, bos_id, template if isinstance(template, str) else None, special)


def _gguf_tokenizer(path: Path) -> LoadedTokenizer:
    ckpt = open_gguf(path)
    vocab = ckpt.tokenizer_source
    return LoadedTokenizer(
        ckpt.tokenizer(), vocab.bos_token_id, vocab.chat_template, special_tokens(vocab)
    )
