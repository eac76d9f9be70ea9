"""OpenAI response bodies: completions and chat, whole or as stream chunks.

A `Format` turns the control plane's messages (one `ChoiceEvent` at a time) into chunks, and
the collected `ChoiceState`s into the non-streamed body, so the two paths share every field.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.choices import ChoiceEvent
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

    def add(self, ev: ChoiceEvent) -> None:
        m = ev.message
        if m.text:
            self.text.append(m.text)
        self.logprobs.extend(m.logprobs)
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


def completion_logprobs(lps: list[common_pb2.TokenLogprobs], offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for lp in lps:
        tokens.append(lp.token)
        token_logprobs.append(_finite(lp.logprob))
        alternatives = {t: _finite(v) for t, v in zip(lp.top_tokens, lp.top_logprobs, strict=False)}
        alternatives.setdefault(lp.token, _finite(lp.logprob))
        top.append(alternatives)
        text_offset.append(offset)
        offset += len(lp.token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    }


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
    """What both endpoints share: the id, the model, the usage chunk."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, logprobs: int | None) -> None:
        self.id = response_id
        self.model = model
        self.logprobs = logprobs
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}

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
    ) -> None:
        super().__init__(response_id, model, logprobs)
        self.echo = echo or {}
        self._echo_pending = dict(self.echo)  # streamed with each choice's first chunk

    def chunk(self, ev: ChoiceEvent) -> dict[str, Any] | None:
        m = ev.message
        prefix = self._echo_pending.pop(ev.index, "")
        if not (prefix or self.worth_sending(m)):
            return None
        lps = None
        if self.logprobs is not None:
            offset = self._offsets.get(ev.index, 0)
            lps = completion_logprobs(list(m.logprobs), offset)
            self._offsets[ev.index] = offset + sum(len(lp.token) for lp in m.logprobs)
        choice = {
            "index": ev.index,
            "text": prefix + m.text,
            "logprobs": lps,
            "finish_reason": m.finish_reason or None,
            "stop_reason": stop_reason(m),
        }
        return self._envelope(self.chunk_object_name, [choice])

    def body(self, states: dict[int, ChoiceState], u: dict[str, int]) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "text": self.echo.get(i, "") + "".join(s.text),
                "logprobs": None if self.logprobs is None else completion_logprobs(s.logprobs),
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
            }
            for i, s in sorted(states.items())
        ]
        return {**self._envelope(self.object_name, choices), "usage": u}


class ChatFormat(Format):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def head(self, indices: list[int]) -> list[dict[str, Any]]:
        """The role arrives first, once per choice, as OpenAI streams it."""
        return [
            self._envelope(
                self.chunk_object_name,
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for i in indices
        ]

    def chunk(self, ev: ChoiceEvent) -> dict[str, Any] | None:
        m = ev.message
        if not self.worth_sending(m):
            return None
        lps = None
        if self.logprobs is not None:
            lps = chat_logprobs(list(m.logprobs), self.logprobs)
        choice = {
            "index": ev.index,
            "delta": {"content": m.text} if m.text else {},
            "logprobs": lps,
            "finish_reason": m.finish_reason or None,
            "stop_reason": stop_reason(m),
        }
        return self._envelope(self.chunk_object_name, [choice])

    def body(self, states: dict[int, ChoiceState], u: dict[str, int]) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(s.text)},
                "logprobs": None
                if self.logprobs is None
                else chat_logprobs(s.logprobs, self.logprobs),
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
            }
            for i, s in sorted(states.items())
        ]
        return {**self._envelope(self.object_name, choices), "usage": u}
