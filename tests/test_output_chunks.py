"""How a request's output chunks reach its client: merged per completion, or held until the
completion ends (final-only)."""

from __future__ import annotations

import asyncio

from control_plane.request import Request
from control_plane.streams import OutputChunk, RequestStream, merge_chunks
from pagedserve.plan import SampledToken
from pagedserve.sampling_params import SamplingParams


def chunk(index: int, *tokens: int, finish: str | None = None, last: bool = False) -> OutputChunk:
    return OutputChunk(
        token_ids=list(tokens),
        text="".join(f"<{t}>" for t in tokens),
        logprobs=[SampledToken(t) for t in tokens],
        num_prompt_tokens=3,
        num_output_tokens=tokens[-1] if tokens else 0,
        finish_reason=finish,
        index=index,
        last=last,
    )


def test_merge_chunks_joins_runs_of_one_completion_in_order() -> None:
    err = RuntimeError("worker gone")
    items: list[OutputChunk | BaseException] = [
        chunk(0, 1),
        chunk(0, 2),
        chunk(1, 1),
        chunk(0, 3, finish="length"),
        chunk(0, 4),  # never merged into a finished chunk
        err,
        chunk(1, 2, last=True),
    ]
    out = merge_chunks(items)
    assert [(c.index, c.token_ids) for c in out if isinstance(c, OutputChunk)] == [
        (0, [1, 2]),
        (1, [1]),
        (0, [3]),
        (0, [4]),
        (1, [2]),
    ]
    assert out[4] is err
    first = out[0]
    assert isinstance(first, OutputChunk)
    assert first.text == "<1><2>" and [s.token_id for s in first.logprobs] == [1, 2]
    assert first.num_output_tokens == 2


def _stream(n: int, final_only: bool) -> RequestStream:
    req = Request("r", [1, 2, 3], SamplingParams(n=n), arrival_time=10.0)
    stream = RequestStream(req, [], [0] * n, final_only)
    stream.first_token_time = 10.25
    return stream


def _drain(stream: RequestStream) -> list[OutputChunk]:
    out = []
    while not stream.queue.empty():
        item = stream.queue.get_nowait()
        assert isinstance(item, OutputChunk)
        out.append(item)
    return out


def test_final_only_holds_each_completion_until_it_ends() -> None:
    async def run() -> None:
        stream = _stream(2, final_only=True)
        for c in (chunk(0, 1), chunk(1, 1), chunk(0, 2), chunk(1, 2, finish="stop")):
            stream.emit(c)
        [one] = _drain(stream)
        assert (one.index, one.token_ids, one.finish_reason) == (1, [1, 2], "stop")
        assert one.time_to_first_token_s == 0.25
        stream.emit(chunk(0, 3, finish="length", last=True))
        [zero] = _drain(stream)
        assert (zero.index, zero.token_ids, zero.text, zero.last) == (
            0,
            [1, 2, 3],
            "<1><2><3>",
            True,
        )

    asyncio.run(run())


def test_final_only_abort_delivers_what_every_completion_had() -> None:
    async def run() -> None:
        stream = _stream(2, final_only=True)
        for c in (chunk(0, 1), chunk(1, 1), chunk(1, 2)):
            stream.emit(c)
        stream.emit(chunk(0, finish="abort", last=True))
        out = _drain(stream)
        assert [(c.index, c.token_ids, c.finish_reason) for c in out] == [
            (1, [1, 2], None),
            (0, [1], "abort"),
        ]
        assert out[-1].last

    asyncio.run(run())


def test_delta_stream_passes_every_chunk_on() -> None:
    async def run() -> None:
        stream = _stream(1, final_only=False)
        stream.emit(chunk(0, 1))
        stream.emit(chunk(0, 2, finish="length", last=True))
        out = _drain(stream)
        assert [c.token_ids for c in out] == [[1], [2]]
        assert out[0].time_to_first_token_s is None and out[1].time_to_first_token_s == 0.25

    asyncio.run(run())
