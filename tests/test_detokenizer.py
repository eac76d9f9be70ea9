"""Incremental detokenization never emits a broken UTF-8 sequence; stop strings cut exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from control_plane.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(micro_llama: Path) -> Tokenizer:
    return Tokenizer.from_file(str(micro_llama / "tokenizer.json"))


def stream(
    tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()
) -> tuple[list[str], str | None]:
    d = IncrementalDetokenizer(tok, [1, 70, 71], stop)
    deltas: list[str] = []
    for i, t in enumerate(ids):
        out = d.add([t], finished=i == len(ids) - 1)
        deltas.append(out.text)
        if out.stop_string is not None:
            return deltas, out.stop_string
    return deltas, None


TEXTS = ["héllo wörld", "日本語のテキスト", "emoji 🎉🚀 mixed ascii", "Ωmega ≈ 3.14 — ok"]


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_round_trips_without_replacement_chars(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text).ids
    deltas, _ = stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=40))
def test_any_text_streams_exactly(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text).ids
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)


@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=1, max_size=40), split=st.integers(0, 40))
def test_deferred_decodes_once_to_the_streamed_text(tok: Tokenizer, text: str, split: int) -> None:
    ids = tok.encode(text).ids
    d = IncrementalDetokenizer(tok, [1, 70, 71], defer=True)
    split = min(split, len(ids) - 1)
    assert d.add(ids[:split], finished=False).text == ""  # nothing before the end
    assert d.add(ids[split:], finished=True).text == "".join(stream(tok, ids)[0])


def test_stop_strings_cannot_defer(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tok, [1], stop=("x",), defer=True)


def test_stop_string_across_tokens_is_cut_and_never_streamed(tok: Tokenizer) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    ids = tok.encode(text).ids
    deltas, matched = stream(tok, ids, stop=("fox j",))
    assert matched == "fox j"
    assert "".join(deltas) == "the quick brown "
    deltas, matched = stream(tok, ids, stop=("zzz", "lazy"))
    assert matched == "lazy" and "".join(deltas) == "the quick brown fox jumps over the "


def test_held_back_text_is_flushed_at_finish(tok: Tokenizer) -> None:
    ids = tok.encode("abcdef").ids
    deltas, matched = stream(tok, ids, stop=("xyz123",))
    assert matched is None and "".join(deltas) == "abcdef"
