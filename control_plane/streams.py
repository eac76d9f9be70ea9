"""What a client request receives: its stream of output chunks, one per step and completion.

An engine loop publishes each step's tokens to the streams of the client requests they belong
to; the gRPC servicer reads the streams (`control_plane.server`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from control_plane.detokenizer import IncrementalDetokenizer
from control_plane.request import Request
from control_plane.scheduler import RequestOutputDelta
from pagedserve.plan import SampledToken


@dataclass
class OutputChunk:
    """What a client receives after a step: the new tokens and the text they completed."""

    token_ids: list[int]
    text: str
    logprobs: list[SampledToken]
    num_prompt_tokens: int
    num_output_tokens: int  # of this completion (index), so far
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # a stop token id or a stop string
    index: int = 0  # which of the request's n completions
    last: bool = False  # nothing follows for this client request
    time_to_first_token_s: float | None = None  # set on a completion's final chunk
    # On the request's first chunk, when asked: prompt tokens 1.. with their logprobs.
    prompt_logprobs: list[SampledToken] | None = None
    sequence_score: float | None = None  # beam search: set on each returned sequence

    @property
    def ends_completion(self) -> bool:
        return self.last or self.finish_reason is not None

    def copy(self) -> OutputChunk:
        """A copy with lists of its own (safe to extend)."""
        return replace(self, token_ids=list(self.token_ids), logprobs=list(self.logprobs))

    def merge(self, later: OutputChunk) -> OutputChunk:
        """This chunk followed by a later one of the same completion, as a new chunk."""
        return self.copy().extend(later)

    def extend(self, later: OutputChunk) -> OutputChunk:
        """Appends a later chunk of the same completion to this one, in place; returns self."""
        self.token_ids.extend(later.token_ids)
        self.text += later.text
        self.logprobs.extend(later.logprobs)
        self.num_prompt_tokens = later.num_prompt_tokens
        self.num_output_tokens = later.num_output_tokens
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.index = later.index
        self.last = later.last
        self.time_to_first_token_s = later.time_to_first_token_s
        self.sequence_score = later.sequence_score
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        return self


def merge_chunks(items: list[OutputChunk | BaseException]) -> list[OutputChunk | BaseException]:
    """Merges each run of consecutive chunks of one completion into one chunk (order kept)."""
    out: list[OutputChunk | BaseException] = []
    for item in items:
        prev = out[-1] if out else None
        if (
            isinstance(item, OutputChunk)
            and isinstance(prev, OutputChunk)
            and prev.index == item.index
            and not prev.ends_completion
        ):
            out[-1] = prev.merge(item)
        else:
            out.append(item)
    return out


@dataclass
class RequestStream:
    """One client request: n completions, each with its own detokenizer and counters.

    final_only: each completion's chunks are held and merged, and reach the queue as one chunk
    when the completion ends (a non-streaming client's single answer).
    sink: where chunks go instead of `queue` (a call carrying many requests collects them all
    in one place, `control_plane.server`)."""

    request: Request
    detokenizers: list[IncrementalDetokenizer]
    num_output_tokens: list[int]
    final_only: bool = False
    queue: asyncio.Queue[OutputChunk | BaseException] = field(default_factory=asyncio.Queue)
    sink: Callable[[OutputChunk | BaseException], None] | None = None
    finished: bool = False
    first_token_time: float | None = None
    finished_indexes: set[int] = field(default_factory=set)  # completions that ended
    prompt_logprobs: list[SampledToken] = field(default_factory=list)  # tokens 1.. of the prompt
    prompt_logprobs_sent: bool = False
    batch_id: str = ""  # the batch it came in (GenerateRequest.batch_id), "" alone
    _held: dict[int, OutputChunk] = field(default_factory=dict)

    def emit(self, chunk: OutputChunk) -> None:
        if chunk.finish_reason is not None:
            self.finished_indexes.add(chunk.index)
        if chunk.ends_completion and self.first_token_time is not None:
            chunk.time_to_first_token_s = self.first_token_time - self.request.arrival_time
        if self.final_only:
            held = self._held.pop(chunk.index, None)
            # The first chunk held is copied, later ones are appended to it in place: one list
            # per completion, not a new one per step.
            chunk = chunk.copy() if held is None else held.extend(chunk)
            if not chunk.ends_completion:
                self._held[chunk.index] = chunk
                return
            if chunk.last:  # an abort ends every completion: what they had goes first
                for other in self._held.values():
                    self.put(other)
                self._held.clear()
        self.put(chunk)

    def chunk_for(self, d: RequestOutputDelta, now: float) -> OutputChunk:
        """The chunk of a step's delta for one of this request's completions. A stop string
        in the text ends the completion: finish_reason "stop", stop_reason the string."""
        r = self.request
        if self.first_token_time is None:
            self.first_token_time = now
        self.num_output_tokens[d.index] += len(d.new_token_ids)
        text = self.detokenizers[d.index].add(d.new_token_ids, d.finished)
        finish_reason: str | None = d.finish_reason
        stop_reason: int | str | None = d.stop_reason
        if text.stop_string is not None:
            finish_reason, stop_reason = "stop", text.stop_string
            if r.sampling.include_stop_str_in_output:
                text = replace(text, text=text.text + text.stop_string)
        chunk = OutputChunk(
            token_ids=d.new_token_ids,
            text=text.text,
            logprobs=d.logprobs,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens[d.index],
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            index=d.index,
            sequence_score=d.sequence_score,
        )
        if r.sampling.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            # The first prompt token has nothing before it: NaN, as "no logprob".
            first = SampledToken(r.prompt_token_ids[0], math.nan, rank=0)
            chunk.prompt_logprobs = [first, *self.prompt_logprobs]
            self.prompt_logprobs_sent = True
        return chunk

    def end_aborted(self) -> None:
        """Ends every completion still open with "abort", the last of them closing the call."""
        self.finished = True
        r = self.request
        open_ = [i for i in range(r.sampling.n) if i not in self.finished_indexes]
        for k, i in enumerate(open_):
            detok = self.detokenizers[i]
            text = detok.add([], finished=True).text if detok.defer else ""
            self.emit(
                OutputChunk(
                    [],
                    text,
                    [],
                    r.num_prompt_tokens,
                    self.num_output_tokens[i],
                    "abort",
                    index=i,
                    last=k == len(open_) - 1,
                )
            )

    def put(self, item: OutputChunk | BaseException) -> None:
        if self.sink is not None:
            self.sink(item)
        else:
            self.queue.put_nowait(item)
