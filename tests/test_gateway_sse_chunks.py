"""Stream chunks from templates (`Format.sse_chunk`) against the same chunks built as dicts and
serialised whole: byte for byte, for every kind of text and every message that is not plain
text."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gateway.choices import ChoiceEvent
from gateway.responses import ChatFormat, CompletionFormat, Format, sse
from gateway.tools import HermesParser
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb

TEXTS = [
    "hello",
    " world",
    'a "quoted" \\ back\\slash',
    "line\nbreak\ttab\r",
    "\x00\x01\x1f control",
    "é à ü",
    "漢字かな",
    "emoji 🦙👍🏽",
    "\u2028\u2029 separators",
    "</script>",
    "\ud7ff",
]

FORMATS: dict[str, Callable[[], Format]] = {
    "completion": lambda: CompletionFormat("cmpl-1", "the-model", None),
    "completion n=2": lambda: CompletionFormat("cmpl-2", 'a "model"', None, n=2),
    "completion echo": lambda: CompletionFormat("cmpl-3", "m", None, echo={0: "prompt "}),
    "completion logprobs": lambda: CompletionFormat("cmpl-4", "m", 2),
    "chat": lambda: ChatFormat("chatcmpl-1", "the-model", None),
    "chat logprobs": lambda: ChatFormat("chatcmpl-2", "m", 1),
    "chat tools": lambda: ChatFormat(
        "chatcmpl-3", "m", None, tool_parser=lambda: HermesParser({"get_weather"})
    ),
}


def _messages() -> list[pb.GenerateResponse]:
    lp = common_pb2.TokenLogprobs(token="x", logprob=-0.5, top_tokens=["x"], top_logprobs=[-0.5])
    out = [pb.GenerateResponse(text=t, token_ids=[7]) for t in TEXTS]
    out += [
        pb.GenerateResponse(text="", token_ids=[8]),  # held back: no chunk
        pb.GenerateResponse(text="x", logprobs=[lp]),
        pb.GenerateResponse(text="x", prompt_logprobs=[lp]),
        pb.GenerateResponse(text="end", finish_reason="length"),
        pb.GenerateResponse(text="", finish_reason="stop", stop_token_id=2),
        pb.GenerateResponse(text="y", finish_reason="stop", stop_reason="STOP"),
    ]
    return out


@pytest.mark.parametrize("name", list(FORMATS))
def test_template_chunks_equal_serialised_dicts(name: str) -> None:
    fast, slow = FORMATS[name](), FORMATS[name]()
    slow.created = fast.created
    for index in (0, 1):
        for m in _messages():
            ev = ChoiceEvent(index, m)
            data = slow.chunk(ev)
            assert fast.sse_chunk(ev) == (None if data is None else sse(data)), (name, m)


def test_plain_text_takes_the_template() -> None:
    fmt = CompletionFormat("cmpl-1", "m", None)
    fmt.sse_chunk(ChoiceEvent(0, pb.GenerateResponse(text="a")))
    assert list(fmt._templates) == [0]
    logprobs = CompletionFormat("cmpl-1", "m", 1)
    logprobs.sse_chunk(ChoiceEvent(0, pb.GenerateResponse(text="a")))
    assert not logprobs._templates
