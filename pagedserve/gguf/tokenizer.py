"""The tokenizer a GGUF file describes, as a `tokenizers.Tokenizer`.

Two kinds (`tokenizer.ggml.model`):

* `gpt2`, byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM...), from the file's vocabulary
  (`tokens`, `token_type`) and ranked `merges`;
* `llama`, SentencePiece BPE (Llama 2, Mistral 7B...): pieces spelled with `▁` for a space,
  ranked by their `scores` (merges, when the file has none, follow from them: a piece splits
  into two pieces of the vocabulary, merged at the piece's rank), characters outside the
  vocabulary spelled as byte tokens `<0x..>`, a `▁` before the text unless
  `add_space_prefix` is false.

How byte-level text is split into words before BPE is not stored, only named
(`tokenizer.ggml.pre`); each name means the split its model was trained with, as llama.cpp
defines it:

    gpt2                          GPT-2's pattern
    smollm, starcoder, refact...  every digit alone, then GPT-2's pattern
    llama-bpe, llama3, ...        Llama 3's pattern (numbers in runs of up to three digits)
    qwen2, deepseek-r1-qwen       Qwen2's pattern (every digit alone)

Control tokens (`<|im_end|>`...) are special: matched whole in text and skipped on decode when
asked; user-defined ones are matched whole and kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pagedserve.gguf.errors import GGUFError

# llama.cpp's token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BYTE_LEVEL, SENTENCEPIECE = "gpt2", "llama"
SPACE = "\u2581"  # SentencePiece's visible space

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = "gpt2"  # tokenizers' built-in ByteLevel pattern
_DIGITS_THEN_GPT2 = "digits+gpt2"
# llama.cpp's `default` (what a file without the key gets) is a split of its own, not GPT-2's:
# not supported, rather than silently splitting text another way than the model was trained.
PRE_TOKENIZERS: dict[str, str] = {
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.*` fields of a GGUF file, checked."""

    model: str  # BYTE_LEVEL or SENTENCEPIECE
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]  # "left right", best first; may be empty for SentencePiece
    scores: tuple[float, ...]  # SentencePiece piece scores (higher merges first)
    pre: str
    add_space_prefix: bool
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # EOS, then end-of-turn / end-of-message tokens
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    @classmethod
    def from_metadata(cls, path: Path, meta: dict[str, Any]) -> GGUFVocab:
        kind = meta.get("tokenizer.ggml.model")
        if kind is None:
            raise GGUFError(f"{path}: no tokenizer (tokenizer.ggml.model is absent)")
        if kind not in (BYTE_LEVEL, SENTENCEPIECE):
            raise GGUFError(
                f"{path}: unsupported tokenizer model {kind!r} (tokenizer.ggml.model); "
                "supported: gpt2 (byte-level BPE), llama (SentencePiece BPE)"
            )
        pre = str(meta.get("tokenizer.ggml.pre", "default"))  # llama.cpp's name when absent
        if kind == BYTE_LEVEL and pre not in PRE_TOKENIZERS:
            raise GGUFError(
                f"{path}: unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
            )
        tokens = tuple(str(t) for t in meta.get("tokenizer.ggml.tokens") or ())
        merges = tuple(str(m) for m in meta.get("tokenizer.ggml.merges") or ())
        scores = tuple(float(x) for x in meta.get("tokenizer.ggml.scores") or ())
        if not tokens:
            raise GGUFError(f"{path}: the tokenizer has no tokens")
        if kind == BYTE_LEVEL and not merges:
            raise GGUFError(f"{path}: the byte-level tokenizer has no merges")
        if kind == SENTENCEPIECE and not merges and len(scores) != len(tokens):
            raise GGUFError(f"{path}: the SentencePiece tokenizer has neither merges nor scores")
        types = tuple(int(t) for t in meta.get("tokenizer.ggml.token_type") or ())
        types = types or (NORMAL,) * len(tokens)
        if len(types) != len(tokens):
            raise GGUFError(f"{path}: {len(types)} token types for {len(tokens)} tokens")

        def token_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            if value is None:
                return None
            if not 0 <= int(value) < len(tokens):
                raise GGUFError(f"{path}: tokenizer.ggml.{key} {value} is outside the vocabulary")
            return int(value)

        eos = token_id("eos_token_id")
        ends = [eos, token_id("eot_token_id"), token_id("eom_token_id")]
        eos_ids = tuple(dict.fromkeys(t for t in ends if t is not None))
        template = meta.get("tokenizer.chat_template")
        return cls(
            model=kind,
            tokens=tokens,
            token_types=types,
            merges=merges,
            scores=scores,
            pre=pre,
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            bos_token_id=token_id("bos_token_id"),
            eos_token_id=eos,
            eos_token_ids=eos_ids,
            unk_token_id=token_id("unknown_token_id"),
            pad_token_id=token_id("padding_token_id"),
            # llama.cpp's defaults: SentencePiece vocabularies start every text with BOS.
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", kind == SENTENCEPIECE)),
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=template if isinstance(template, str) else None,
        )

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


@cache
def byte_chars() -> tuple[str, ...]:
    """GPT-2's byte-to-unicode map, in byte order: printable bytes stand for themselves, the
    others take the characters from U+0100 on. Byte-level vocabularies are spelled in it."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return tuple(chars)


def _byte_spelling(text: str) -> str:
    """`text` as a byte-level vocabulary writes it (its UTF-8 bytes, each as one character)."""
    table = byte_chars()
    return "".join(table[b] for b in text.encode("utf-8"))


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    split = PRE_TOKENIZERS[pre]
    if split == _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_tokenizer(v: GGUFVocab) -> Tokenizer:
    tokenizer = _byte_level(v) if v.model == BYTE_LEVEL else _sentencepiece(v)
    tokenizer.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind in zip(v.tokens, v.token_types, strict=True)
            if kind == CONTROL
        ]
    )
    # A user-defined token is matched whole in text; one whose raw text a byte-level vocab
    # had to respell (a space, a newline...) stays a plain vocab entry: added under its raw
    # text it would get a new id past the embedding.
    alphabet = frozenset(byte_chars())
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(v.tokens, v.token_types, strict=True)
        if kind == USER_DEFINED and (v.model != BYTE_LEVEL or set(tok) <= alphabet)
    ]
    if user:
        tokenizer.add_tokens(user)
    tokenizer.post_processor = _post_processor(v)
    return tokenizer


def _parse_merges(merges: tuple[str, ...]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not (left and sep and right):
            raise ValueError(f"malformed merge {merge!r}")
        out.append((left, right))
    return out


def _byte_level(v: GGUFVocab) -> Tokenizer:
    alphabet = frozenset(byte_chars())
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(v.tokens, v.token_types, strict=True)):
        # Normal tokens are stored byte-level spelled; a user-defined one may be raw text.
        spelled = tok if kind == CONTROL or set(tok) <= alphabet else _byte_spelling(tok)
        vocab[spelled] = i
    # Llama 3's tokenizer takes a word that is a whole vocab entry as it is, merges or not.
    ignore_merges = PRE_TOKENIZERS[v.pre] == _LLAMA3
    model = models.BPE(
        vocab=vocab, merges=_parse_merges(v.merges), fuse_unk=False, ignore_merges=ignore_merges
    )
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = _pre_tokenizer(v.pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(v: GGUFVocab) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(v.tokens)}
    merges = _parse_merges(v.merges) if v.merges else merges_from_scores(v.tokens, v.scores)
    unk = v.token(v.unk_token_id)
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    prepend = "first" if v.add_space_prefix else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme=prepend, split=False
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if v.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_from_scores(tokens: tuple[str, ...], scores: tuple[float, ...]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a piece into two pieces of the vocabulary
    is a merge ranked by the piece's score (higher first); among equal scores longer left,
    then longer right parts first, then vocabulary order."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                key = (-score, -len(left), -len(right), ids[piece], ids[left], ids[right])
                ranked.append((*key, left, right))
    ranked.sort(key=lambda r: r[:6])
    return [(r[6], r[7]) for r in ranked]


def _post_processor(v: GGUFVocab) -> processors.PostProcessor:
    bos = v.token(v.bos_token_id) if v.add_bos_token else None
    eos = v.token(v.eos_token_id) if v.add_eos_token else None
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    first = [bos, "$A", eos]
    second = [f"{bos}:1" if bos else None, "$B:1", f"{eos}:1" if eos else None]
    special = [(t, i) for t, i in ((bos, v.bos_token_id), (eos, v.eos_token_id)) if t]
    return processors.TemplateProcessing(
        single=" ".join(p for p in first if p),
        pair=" ".join(p for p in first + second if p),
        special_tokens=list(dict.fromkeys(special)),
    )


def tokenizer_config(v: GGUFVocab, model_max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json` for the converted checkpoint."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": v.add_bos_token,
        "add_eos_token": v.add_eos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    for key, token_id in (
        ("bos_token", v.bos_token_id),
        ("eos_token", v.eos_token_id),
        ("unk_token", v.unk_token_id),
        ("pad_token", v.pad_token_id),
    ):
        if token_id is not None:
            config[key] = v.tokens[token_id]
    if v.chat_template is not None:
        config["chat_template"] = v.chat_template
    return config


def special_tokens(v: GGUFVocab) -> dict[str, str]:
    """bos_token, eos_token, ... as a chat template sees them."""
    config = tokenizer_config(v, 0)
    keys = ("bos_token", "eos_token", "unk_token", "pad_token")
    return {k: config[k] for k in keys if k in config}
