"""Loads a checkpoint's tokenizer and its chat and special-token settings: from tokenizer.json
and tokenizer_config.json in an HF directory, or from the metadata of a GGUF file; the chat
template as control_plane.chat_templates chooses it."""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import AddedToken, Tokenizer

from control_plane.chat import content_spans, render_chat
from control_plane.chat_templates import choose_chat_template
from pagedserve.gguf import find_gguf, open_gguf
from pagedserve.gguf.tokenizer import special_tokens
from pagedserve.log import get_logger
from pagedserve.sampling_params import InvalidRequestError

log = get_logger(__name__)

# Stand-ins for the special token before a stretch of text that is re-tokenized as plain text
# (see `encode`): Unicode noncharacters, which no normalizer changes. One of each kind, as an
# added token splits the text before normalization (normalized=False) or after it.
_ANCHOR = "\ufdd0\ufdd1"
_ANCHOR_NORMALIZED = "\ufdd0\ufdd2"
# Message fields beside role and content that a chat template may render.
_EXTRA_FIELDS = ("name", "tool_calls", "tool_call_id")

Span = tuple[int, int]  # [start, end) character offsets into a text


class ChatPrompt(NamedTuple):
    text: str  # the chat template's rendering
    literal: list[Span]  # message contents holding special-token text, to tokenize as text


@dataclass
class LoadedTokenizer:
    tokenizer: Tokenizer
    bos_token_id: int | None
    chat_template: str | None
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the chat template sees them

    def chat_prompt(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        """The rendered chat (with `tools` for a template that renders them, and the template
        variables `template_kwargs` over the special tokens' texts), and where special tokens
        typed in its messages lie: `encode` with those spans puts special tokens only where the
        template writes them."""
        variables: dict[str, Any] = {**self.special_tokens, **(template_kwargs or {})}
        if tools is not None:
            variables["tools"] = tools
        text = render_chat(self.chat_template, messages, add_generation_prompt, variables)
        if self.special_text_in(m["role"] for m in messages):
            raise InvalidRequestError("a message role must not hold a special token's text")
        # Tools and kwargs are rendered wherever the template puts them, where no span can
        # mark them as text.
        if tools and self.special_text_in([json.dumps(tools, ensure_ascii=False)]):
            raise InvalidRequestError("tools must not hold a special token's text")
        if template_kwargs and self.special_text_in(
            [json.dumps(template_kwargs, ensure_ascii=False)]
        ):
            raise InvalidRequestError("chat_template_kwargs: must not hold a special token's text")
        extras = (
            json.dumps(m[k], ensure_ascii=False) for m in messages for k in _EXTRA_FIELDS if k in m
        )
        if self.special_text_in(extras):
            raise InvalidRequestError(
                "a message's name, tool calls or tool_call_id must not hold a special token's text"
            )
        if not self.special_text_in(m["content"] for m in messages):
            return ChatPrompt(text, [])
        assert self.chat_template is not None  # render_chat refuses a model without one
        spans = content_spans(self.chat_template, messages, add_generation_prompt, variables, text)
        if spans is None:
            raise InvalidRequestError(
                "a message holds a special token's text, and this model's chat template rewrites "
                "message content, so it cannot be kept apart from the template's own special "
                "tokens; send it as a completions prompt instead"
            )
        return ChatPrompt(text, spans)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def encode(
        self, text: str, add_special_tokens: bool = False, literal: Sequence[Span] = ()
    ) -> list[int]:
        """Token ids of text; add_special_tokens applies the tokenizer's own post-processor
        (BOS for Llama-style tokenizers). Runs without the GIL (`encode` would hold it for the
        whole text, `encode_batch` releases it), so a long prompt tokenized on a thread stalls
        no other Python thread.

        Special-token text inside a `literal` span (a chat message's content) is tokenized as
        the plain text it is, as with transformers' split_special_tokens; elsewhere it is the
        special token. The tokenizer splits text at added tokens before anything else, so
        only the stretch between two of the template's own special tokens that holds a typed
        one is tokenized again, as text; every other id is the whole text's."""
        enc = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        ids: list[int] = enc.ids
        if not literal:
            return ids
        special = self._special_ids
        offsets: list[tuple[int, int]] = enc.offsets  # a new list at every access: read once
        starts = [s for s, _ in literal]
        typed = [
            i
            for i, (t, (start, end)) in enumerate(zip(ids, offsets, strict=True))
            if t in special and end > start and _overlaps(start, end, literal, starts)
        ]
        if not typed:
            return ids
        # Anchors: the special tokens that stay (the template's). Each run of tokens between
        # two anchors that holds a typed special token is one stretch of text, re-tokenized.
        typed_set = set(typed)
        anchors = [i for i, t in enumerate(ids) if t in special and i not in typed_set]
        out: list[int] = []
        done = 0  # ids[:done] are settled
        for i in typed:
            if i < done:
                continue
            k = bisect.bisect(anchors, i)  # anchors[k - 1] < i < anchors[k]
            before = anchors[k - 1] if k > 0 else -1
            after = anchors[k] if k < len(anchors) else len(ids)
            start = offsets[before][1] if before >= 0 else 0
            end = offsets[after][0] if after < len(ids) else len(text)
            out += ids[done : before + 1]
            out += self._encode_as_text(text[start:end], ids[before] if before >= 0 else None)
            done = after
        return out + ids[done:]

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._added.items() if t.special)

    @cached_property
    def _text_tokenizers(self) -> tuple[Tokenizer, Tokenizer]:
        """Copies that tokenize special-token text as text: as is, and with the anchors."""
        plain = Tokenizer.from_str(self.tokenizer.to_str())
        plain.encode_special_tokens = True
        anchored = Tokenizer.from_str(plain.to_str())
        anchored.encode_special_tokens = True
        anchored.add_tokens(
            [
                AddedToken(_ANCHOR, special=False, normalized=False),
                AddedToken(_ANCHOR_NORMALIZED, special=False, normalized=True),
            ]
        )
        return plain, anchored

    def _encode_as_text(self, stretch: str, before: int | None) -> list[int]:
        """Ids of a stretch of text that follows special token `before` (None: the text's
        start), special-token text in it as plain text. An anchor of the same kind stands in
        for `before`, so the stretch is tokenized as it would be in place (a SentencePiece
        space prefix, say, only at the text's start)."""
        plain, anchored = self._text_tokenizers
        normalized = before is not None and self._added[before].normalized
        anchor = _ANCHOR_NORMALIZED if normalized else _ANCHOR
        if before is None or _ANCHOR in stretch or _ANCHOR_NORMALIZED in stretch:
            ids: list[int] = plain.encode_batch([stretch], add_special_tokens=False)[0].ids
            return ids
        ids = anchored.encode_batch([anchor + stretch], add_special_tokens=False)[0].ids
        assert ids[0] == anchored.token_to_id(anchor)
        return ids[1:]

    @cached_property
    def _added(self) -> dict[int, AddedToken]:
        added: dict[int, AddedToken] = self.tokenizer.get_added_tokens_decoder()
        return added

    def special_text_in(self, texts: Iterable[str]) -> bool:
        """Whether any of the texts holds a special token's text."""
        pattern = self._special_pattern
        return pattern is not None and any(pattern.search(t) for t in texts)

    @cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        words = sorted({t.content for t in self._added.values() if t.special and t.content})
        return re.compile("|".join(map(re.escape, words))) if words else None

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its vocabulary entry is at
        least as long (byte-level entries spell one character per byte, SentencePiece pieces
        one per character, byte-fallback tokens `<0xNN>` six for one byte). A text longer than
        this times a context length can never fit it, whatever it holds."""
        return max(len(piece) for piece in self.tokenizer.get_vocab(with_added_tokens=True))


def _overlaps(start: int, end: int, spans: Sequence[Span], starts: list[int]) -> bool:
    """Whether [start, end) meets one of `spans` (in order, disjoint; `starts` their starts)."""
    k = bisect.bisect_left(starts, end)  # spans[:k] start before `end`
    return k > 0 and spans[k - 1][1] > start


def load_tokenizer(model_path: str | Path, chat_template: str | None = None) -> LoadedTokenizer:
    """The checkpoint's tokenizer; its chats rendered with `chat_template` (the text
    `--chat-template` gave) when set, else as choose_chat_template picks for the checkpoint."""
    loaded = _load(model_path)
    chosen = choose_chat_template(loaded.chat_template, chat_template)
    log.info("chat_template", source=chosen.source)
    loaded.chat_template = chosen.text
    return loaded


def _load(model_path: str | Path) -> LoadedTokenizer:
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
