"""OpenAI response bodies: completions and chat, whole or as stream chunks.

A `Format` turns the control plane's messages (one `ChoiceEvent` at a time) into chunks, and
the collected `ChoiceState`s into the non-streamed body, so the two paths share every field.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.choices import ChoiceEvent
from gateway.tool_parsers import Parsed, ToolCallParser, merge_calls
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb

# What -inf becomes in JSON, which has no infinities (vLLM's choice too).
NEG_INF_LOGPROB = -9999.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF_LOGPROB


def stop_reason(m: pb.GenerateResponse) -> int | str | None:
    """The stop token id as an integer, the stop string as a string, else None (as vLLM)."""
    if m.HasField("stop_token_id"):
        return m.stop_token_id
    return m.stop_reason or None


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)

    def add(self, ev: ChoiceEvent) -> None:
        m = ev.message
        if m.text:
            self.text.append(m.text)
        self.logprobs.extend(m.logprobs)
        if m.prompt_logprobs:
            self.prompt_logprobs = list(m.prompt_logprobs)
        self.prompt_tokens = m.prompt_tokens
        self.completion_tokens = m.completion_tokens
        if m.finish_reason:
            self.finish_reason = m.finish_reason
            self.stop_reason = stop_reason(m)


def usage(states: dict[int, ChoiceState], n: int) -> dict[str, int]:
    """The prompt counts once per prompt (not per choice), completions once per choice."""
    prompt_by_group: dict[int, int] = {}
    for index, s in states.items():
        prompt_by_group[index // n] = max(prompt_by_group.get(index // n, 0), s.prompt_tokens)
    prompt = sum(prompt_by_group.values())
    completion = sum(s.completion_tokens for s in states.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_logprobs(
    lps: list[common_pb2.TokenLogprobs], offset: int = 0, top_k: int | None = None
) -> dict[str, Any]:
    """OpenAI's legacy logprobs. A NaN logprob (the first prompt token, echoed) is null, as are
    its alternatives; top_k cuts the alternatives (prompt tokens may carry more)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for lp in lps:
        tokens.append(lp.token)
        text_offset.append(offset)
        offset += len(lp.token)
        if math.isnan(lp.logprob):
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_finite(lp.logprob))
        pairs = list(zip(lp.top_tokens, lp.top_logprobs, strict=False))[:top_k]
        alternatives = {t: _finite(v) for t, v in pairs}
        alternatives.setdefault(lp.token, _finite(lp.logprob))
        top.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    }


def prompt_logprobs_body(lps: list[common_pb2.TokenLogprobs]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else the token and its
    alternatives by token id, each with its logprob, rank and text."""
    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if math.isnan(lp.logprob):
            out.append(None)
            continue
        entry = {
            str(lp.token_id): {
                "logprob": _finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.token,
            }
        }
        ranked = zip(lp.top_token_ids, lp.top_logprobs, lp.top_tokens, strict=False)
        for rank, (token_id, value, text) in enumerate(ranked, start=1):
            entry.setdefault(
                str(token_id), {"logprob": _finite(value), "rank": rank, "decoded_token": text}
            )
        out.append(entry)
    return out


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}


def chat_logprobs(lps: list[common_pb2.TokenLogprobs], top_k: int) -> dict[str, Any]:
    content = []
    for lp in lps:
        entry = _token_entry(lp.token, lp.logprob)
        entry["top_logprobs"] = [
            _token_entry(t, v)
            for t, v in list(zip(lp.top_tokens, lp.top_logprobs, strict=False))[:top_k]
        ]
        content.append(entry)
    return {"content": content}


class Format:
    """What both endpoints share: the id, the model, the usage chunk, and the prompt logprobs
    that came on one choice of each prompt's n and belong to all of them."""

    object_name = ""
    chunk_object_name = ""

    def __init__(
        self,
        response_id: str,
        model: str,
        logprobs: int | None,
        n: int = 1,
        prompt_logprobs: int | None = None,
    ) -> None:
        self.id = response_id
        self.model = model
        self.logprobs = logprobs
        self.n = n
        self.prompt_logprobs = prompt_logprobs
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}
        self._prompt_lps: dict[int, list[common_pb2.TokenLogprobs]] = {}  # by prompt

    def prompt_lps(self, index: int, m: pb.GenerateResponse | None = None) -> list[Any]:
        """Choice index's prompt logprobs: those m carries (kept for its siblings), or those a
        sibling's message carried."""
        if m is not None and m.prompt_logprobs:
            self._prompt_lps[index // self.n] = list(m.prompt_logprobs)
        return self._prompt_lps.get(index // self.n, [])

    def _body_prompt_lps(self, states: dict[int, ChoiceState]) -> None:
        for i, s in sorted(states.items()):
            if s.prompt_logprobs:
                self._prompt_lps[i // self.n] = s.prompt_logprobs

    def worth_sending(self, m: pb.GenerateResponse) -> bool:
        """A stream chunk goes out only with something in it: text, the finish, or logprobs the
        client asked for. Tokens whose text is held back (part of a UTF-8 character, a possible
        stop string) make no chunk of their own."""
        return bool(m.text or m.finish_reason or (self.logprobs is not None and m.logprobs))

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def head(self, indices: list[int]) -> list[dict[str, Any]]:
        return []

    def usage_chunk(self, u: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name, []), "usage": u}

    def chunk(self, ev: ChoiceEvent) -> dict[str, Any] | None:
        raise NotImplementedError

    def body(self, states: dict[int, ChoiceState], u: dict[str, int]) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(Format):
    """echo: the prompt text of each choice index, put before its completion's text."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(
        self,
        response_id: str,
        model: str,
        logprobs: int | None,
        echo: dict[int, str] | None = None,
        n: int = 1,
        prompt_logprobs: int | None = None,
    ) -> None:
        super().__init__(response_id, model, logprobs, n, prompt_logprobs)
        self.echo = echo or {}
        self._echo_pending = dict(self.echo)  # streamed with each choice's first chunk

    def _logprobs(self, index: int, generated: list[Any], first: bool) -> dict[str, Any]:
        """The choice's logprobs from its offset on; echoed, its first part starts with the
        prompt's tokens."""
        lps = list(generated)
        if first and index in self.echo:
            lps = self.prompt_lps(index) + lps
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + sum(len(lp.token) for lp in lps)
        return completion_logprobs(lps, offset, self.logprobs)

    def chunk(self, ev: ChoiceEvent) -> dict[str, Any] | None:
        m = ev.message
        self.prompt_lps(ev.index, m)
        first = ev.index in self._echo_pending
        prefix = self._echo_pending.pop(ev.index, "")
        if not (prefix or self.worth_sending(m)):
            return None
        lps = None
        if self.logprobs is not None:
            lps = self._logprobs(ev.index, list(m.logprobs), first)
        choice = {
            "index": ev.index,
            "text": prefix + m.text,
            "logprobs": lps,
            "finish_reason": m.finish_reason or None,
            "stop_reason": stop_reason(m),
        }
        return self._envelope(self.chunk_object_name, [choice])

    def body(self, states: dict[int, ChoiceState], u: dict[str, int]) -> dict[str, Any]:
        self._body_prompt_lps(states)
        choices = []
        for i, s in sorted(states.items()):
            choice = {
                "index": i,
                "text": self.echo.get(i, "") + "".join(s.text),
                "logprobs": None
                if self.logprobs is None
                else self._logprobs(i, s.logprobs, first=True),
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
            }
            if self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_body(self.prompt_lps(i))
            choices.append(choice)
        return {**self._envelope(self.object_name, choices), "usage": u}


class ChatFormat(Format):
    """With `tool_parser` (a factory), each choice's text goes through its own parser: tool
    calls come back as `tool_calls`, and a choice that made calls and ended by itself has
    finish_reason "tool_calls"."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        response_id: str,
        model: str,
        logprobs: int | None,
        n: int = 1,
        prompt_logprobs: int | None = None,
        tool_parser: Callable[[], ToolCallParser] | None = None,
        head_content: str | None = "",
    ) -> None:
        super().__init__(response_id, model, logprobs, n, prompt_logprobs)
        self.tool_parser = tool_parser
        self.head_content = head_content
        self._parsers: dict[int, ToolCallParser] = {}

    def head(self, indices: list[int]) -> list[dict[str, Any]]:
        """The role arrives first, once per choice, as OpenAI streams it."""
        return [
            self._envelope(
                self.chunk_object_name,
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": self.head_content},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for i in indices
        ]

    @staticmethod
    def _finish_reason(finish_reason: str | None, parser: ToolCallParser | None) -> str | None:
        if finish_reason == "stop" and parser is not None and parser.num_calls:
            return "tool_calls"
        return finish_reason

    def chunk(self, ev: ChoiceEvent) -> dict[str, Any] | None:
        m = ev.message
        lps = None
        if self.logprobs is not None:
            lps = chat_logprobs(list(m.logprobs), self.logprobs)
        if self.tool_parser is None:
            if not self.worth_sending(m):
                return None
            delta: dict[str, Any] = {"content": m.text} if m.text else {}
            finish = m.finish_reason or None
        else:
            parser = self._parsers.get(ev.index)
            if parser is None:
                parser = self._parsers[ev.index] = self.tool_parser()
            parsed = parser.feed(m.text)
            if m.finish_reason:
                rest = parser.finish()
                parsed = Parsed(parsed.content + rest.content, parsed.calls + rest.calls)
            finish = self._finish_reason(m.finish_reason or None, parser)
            delta = {}
            if parsed.content:
                delta["content"] = parsed.content
            if parsed.calls:
                delta["tool_calls"] = parsed.calls
            if not (delta or finish or (lps is not None and m.logprobs)):
                return None
        choice = {
            "index": ev.index,
            "delta": delta,
            "logprobs": lps,
            "finish_reason": finish,
            "stop_reason": stop_reason(m),
        }
        return self._envelope(self.chunk_object_name, [choice])

    def _message(self, s: ChoiceState) -> tuple[dict[str, Any], str | None]:
        text = "".join(s.text)
        if self.tool_parser is None:
            return {"role": "assistant", "content": text}, s.finish_reason
        parser = self.tool_parser()
        parsed = parser.feed(text)
        rest = parser.finish()
        calls = merge_calls(parsed.calls + rest.calls)
        content = parsed.content + rest.content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["content"] = content or None
            message["tool_calls"] = calls
        return message, self._finish_reason(s.finish_reason, parser)

    def body(self, states: dict[int, ChoiceState], u: dict[str, int]) -> dict[str, Any]:
        choices = []
        for i, s in sorted(states.items()):
            message, finish = self._message(s)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": None
                    if self.logprobs is None
                    else chat_logprobs(s.logprobs, self.logprobs),
                    "finish_reason": finish,
                    "stop_reason": s.stop_reason,
                }
            )
        out = {**self._envelope(self.object_name, choices), "usage": u}
        if self.prompt_logprobs is not None:
            self._body_prompt_lps(states)
            out["prompt_logprobs"] = prompt_logprobs_body(self.prompt_lps(0))
        return out
