"""Tool-call parsing: a choice's text in, OpenAI content and tool-call deltas out, chunk by
chunk. One parser per `tool_choice` mode: `HermesParser` ("auto": calls in `<tool_call>` tags
anywhere in the text), `CallListParser` ("required": a JSON array of calls) and
`NamedCallParser` (a named function: the whole text is its arguments).

The parsers serve both paths: a whole answer is its text fed at once, so a streamed choice's
deltas add up to exactly what the non-streamed body holds (`merge_calls`).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


_DECODER = json.JSONDecoder()
_SPACE = " \t\r\n"


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _SPACE:
        pos += 1
    return pos


def member_text(text: str, start: int, key: str) -> str | None:
    """The text of member `key`'s value in the JSON object at text[start] as written (so
    arguments keep the model's spacing), or None if it has none or is not an object."""
    if text[start : start + 1] != "{":
        return None
    pos = _skip_space(text, start + 1)
    try:
        while pos < len(text) and text[pos] != "}":
            name, pos = _DECODER.raw_decode(text, pos)
            pos = _skip_space(text, pos)
            if text[pos : pos + 1] != ":":
                return None
            pos = _skip_space(text, pos + 1)
            _, end = _DECODER.raw_decode(text, pos)
            if name == key:
                return text[pos:end]
            pos = _skip_space(text, end)
            if text[pos : pos + 1] == ",":
                pos = _skip_space(text, pos + 1)
    except (json.JSONDecodeError, RecursionError):
        return None
    return None


def _arguments(value: Any, written: str | None) -> str:
    """A call's arguments as OpenAI sends them: JSON text, as the model wrote it when that is
    at hand."""
    if isinstance(value, str):
        return value
    if written is not None:
        return written
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass
class Parsed:
    """What a piece of a choice's text became: content, and tool calls as OpenAI stream
    deltas (`{index, id, type, function: {name, arguments}}`; later deltas of the same index
    carry more `arguments`)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class ToolCallParser:
    """A choice's text in, content and tool-call deltas out. `feed` as text comes, `finish`
    once at the end."""

    def __init__(self) -> None:
        self.num_calls = 0

    def _call(self, name: str, arguments: str) -> dict[str, Any]:
        delta = {
            "index": self.num_calls,
            "id": call_id(),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        self.num_calls += 1
        return delta

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        raise NotImplementedError


class NamedCallParser(ToolCallParser):
    """A named function: the whole text is its arguments, passed on as it comes."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Parsed:
        if not text:
            return Parsed()
        if self.num_calls == 0:
            return Parsed(calls=[self._call(self.name, text)])
        return Parsed(calls=[{"index": 0, "function": {"arguments": text}}])

    def finish(self) -> Parsed:
        if self.num_calls == 0:
            return Parsed(calls=[self._call(self.name, "")])
        return Parsed()


class CallListParser(ToolCallParser):
    """`tool_choice: "required"`: a JSON array of `{"name", "parameters"}`, each call given
    out once its object is complete. Text that never made a call (cut by max_tokens before the
    first one closed) is given out as content at the end."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names
        self._text = ""
        self._pos = 0
        self._opened = False
        self._done = False

    def feed(self, text: str) -> Parsed:
        self._text += text
        out = Parsed()
        if "}" not in text and not (not self._opened and "[" in text):
            return out
        while not self._done:
            rest = self._text[self._pos :]
            stripped = rest.lstrip(" \t\r\n,")
            self._pos += len(rest) - len(stripped)
            if not stripped:
                break
            if not self._opened:
                if stripped[0] != "[":
                    self._done = True
                    break
                self._opened = True
                self._pos += 1
                continue
            if stripped[0] == "]":
                self._done = True
                break
            start = self._pos
            try:
                item, end = _DECODER.raw_decode(self._text, start)
            except json.JSONDecodeError:
                break  # not complete yet
            except RecursionError:  # nested past what the decoder takes: not a call
                self._done = True
                break
            self._pos = end
            if not (isinstance(item, dict) and item.get("name") in self.names):
                self._done = True
                break
            written = member_text(self._text, start, "parameters")
            args = _arguments(item.get("parameters", {}), written)
            out.calls.append(self._call(item["name"], args))
        return out

    def finish(self) -> Parsed:
        if self.num_calls == 0 and self._text:
            return Parsed(content=self._text)
        return Parsed()


OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


def _tag_prefix_len(text: str) -> int:
    """Length of the longest end of `text` that is the start of OPEN_TAG."""
    for n in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolCallParser):
    """`tool_choice: "auto"`: calls written as Hermes and Qwen models write them,
    `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, or as SmolLM2 writes
    them, a JSON list of such calls in one block (`<tool_call>[{...}, {...}]</tool_call>`;
    `[]`, its word for no call, is dropped), anywhere in the text. The text around them is
    content: the whitespace before a call is dropped, and the whitespace after one is kept
    only between two pieces of text. A block that does not hold calls of the tools only (bad
    JSON, an unknown name) stays content as written. Streamed content holds back what may
    start a block (trailing whitespace, part of the tag) until the next text says."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names
        self._outside = ""  # text after the last block, not given out yet
        self._block: str | None = None  # inside a block: its text so far
        self._space_before = ""  # the whitespace held before the open block
        self._after_call = False  # only whitespace since the last call
        self._emitted = False  # some content has been given out

    def _emit(self, out: Parsed, text: str) -> None:
        if text:
            out.content += text
            self._emitted = True

    def _parse_item(self, data: Any, text: str, start: int) -> tuple[str, str] | None:
        """(name, arguments) of the call `data` written at text[start], or None if it is not
        a call of one of the tools."""
        if not isinstance(data, dict) or data.get("name") not in self.names:
            return None
        key = "arguments" if "arguments" in data else "parameters"
        args = data.get(key, {})
        if not isinstance(args, dict | str):
            return None
        return data["name"], _arguments(args, member_text(text, start, key))

    def _parse_calls(self, body: str) -> list[tuple[str, str]] | None:
        """The calls a block's (stripped) text holds, all or none: None unless it is one call
        or a list of calls, every one of a tool."""
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(data, list):
            call = self._parse_item(data, body, 0)
            return None if call is None else [call]
        calls = []
        for item, start in _list_items(body):
            call = self._parse_item(item, body, start)
            if call is None:
                return None
            calls.append(call)
        return calls

    def _close(self, body: str, closed: bool, out: Parsed) -> None:
        calls = self._parse_calls(body.strip())
        if calls is not None:
            out.calls += [self._call(name, arguments) for name, arguments in calls]
            self._after_call = True
        else:
            end = CLOSE_TAG if closed else ""
            self._emit(out, self._space_before + OPEN_TAG + body + end)
        self._space_before = ""
        self._block = None

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if self._block is None:
            self._outside += text
        else:
            self._block += text
        while True:
            if self._block is not None:
                end = self._block.find(CLOSE_TAG)
                if end < 0:
                    break
                rest = self._block[end + len(CLOSE_TAG) :]
                self._close(self._block[:end], True, out)
                self._outside = rest
                continue
            if self._after_call:
                text_after = self._outside.lstrip()
                if not text_after:
                    break
                space = self._outside[: len(self._outside) - len(text_after)]
                self._outside = (space if self._emitted else "") + text_after
                self._after_call = False
            start = self._outside.find(OPEN_TAG)
            if start < 0:
                break
            before = self._outside[:start]
            kept = before.rstrip()
            self._emit(out, kept)
            self._space_before = before[len(kept) :]
            self._block = self._outside[start + len(OPEN_TAG) :]
            self._outside = ""
        if self._block is None and not self._after_call:
            held = _tag_prefix_len(self._outside)
            kept = self._outside[: len(self._outside) - held].rstrip()
            self._emit(out, kept)
            self._outside = self._outside[len(kept) :]
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self._block is not None:
            self._close(self._block, False, out)
        elif not self._after_call:
            self._emit(out, self._outside)
        self._outside = ""
        return out


def _list_items(text: str) -> list[tuple[Any, int]]:
    """Each item of the JSON list that is `text` (valid JSON), with where it starts."""
    items = []
    pos = _skip_space(text, 1)
    while text[pos] != "]":
        item, end = _DECODER.raw_decode(text, pos)
        items.append((item, pos))
        pos = _skip_space(text, end)
        if text[pos] == ",":
            pos = _skip_space(text, pos + 1)
    return items


def merge_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole tool calls from their stream deltas, in index order."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.get(d["index"])
        if call is None:
            calls[d["index"]] = {
                "id": d["id"],
                "type": d["type"],
                "function": {"name": d["function"]["name"], "arguments": ""},
            }
            call = calls[d["index"]]
        call["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]
