"""Incremental detokenization and stop strings, per request.

Text is emitted only when it is complete: a byte-level token may end in the middle of a UTF-8
character, so a decode ending in U+FFFD is held back until a later token completes it. Stop
strings are matched on the accumulated text; while a request runs, the last
len(longest stop) - 1 characters are held back too, so a stop string that spans tokens is cut
exactly and no part of it is ever streamed.

A detokenizer made with `defer` (a client that reads only the final text, no stop strings)
just collects tokens and decodes them once, when the request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

# Prompt tokens decoded with the output so that the first output token's text (a leading space,
# a merged character) renders as it will in the full text.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


@dataclass
class TextDelta:
    text: str
    stop_string: str | None  # the stop string that matched, if one did


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        defer: bool = False,
    ) -> None:
        if defer and stop:
            raise ValueError("stop strings are matched as text arrives: they cannot defer")
        self.tokenizer = tokenizer
        self.defer = defer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # output text so far (cut at the stop string once one matches)
        self.sent = 0  # characters of self.text already returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int], finished: bool) -> TextDelta:
        """Adds new tokens; returns the text that may be emitted now."""
        self.tokens.extend(token_ids)
        if self.defer and not finished:
            return TextDelta("", None)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and (finished or not full.endswith(REPLACEMENT)):
            new = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            before = len(self.text)
            self.text += new
            matched = self._match_stop(before, len(new))
            if matched is not None:
                return TextDelta(self._flush(), matched)
        return TextDelta(self._flush() if finished else self._emit(), None)

    def _match_stop(self, before: int, added: int) -> str | None:
        if not self.stop:
            return None
        # Only a window that includes new text can hold a new match.
        start = max(0, before - self.hold_back)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def _emit(self) -> str:
        end = max(self.sent, len(self.text) - self.hold_back)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def _flush(self) -> str:
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out
