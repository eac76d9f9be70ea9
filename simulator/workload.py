"""Synthetic traffic for the simulator: arrivals, lengths, shared prefixes, sessions, traces.

Lengths. `sharegpt` and `alpaca` are log-normal fits whose means are the PagedAttention
paper's dataset means (ShareGPT: 161.31 prompt and 337.99 output tokens; Alpaca: 19.31 and
58.45, so ShareGPT's are 8.4x and 5.8x longer), with the shape parameter sigma chosen here
(the paper gives histograms, not fits): 1.0 for ShareGPT's heavy-tailed chat and 0.6 for
Alpaca's short instructions. mu = ln(mean) - sigma^2 / 2 keeps the mean; draws are clipped to
[1, max_model_len] (prompt first, then the output to what is left), which trims the means
slightly; `WorkloadStats` reports the realised ones.

Arrivals: Poisson at a rate, or bursty: gamma inter-arrival gaps with the same mean and a
coefficient of variation `cv` (> 1 clumps requests into bursts).

Prompts are token ids from a seeded generator. With `num_prefixes` K > 0 every prompt starts
with one of K shared system prompts of `prefix_len` tokens (chosen uniformly). With
`turns` > 1 each arrival opens a session: every later turn's prompt is the previous prompt,
the previous answer (the ids the simulated model produced) and a new user message, sent a
think time after the previous answer ended.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

Arrival = Literal["poisson", "gamma"]

# (prompt mean, prompt sigma, output mean, output sigma)
LENGTHS: dict[str, tuple[float, float, float, float]] = {
    "sharegpt": (161.31, 1.0, 337.99, 1.0),
    "alpaca": (19.31, 0.6, 58.45, 0.6),
}


@dataclass
class SimRequest:
    req_id: str
    arrival_s: float
    prompt_ids: list[int]
    output_len: int
    session: Session | None = None
    # Ends by length (max_tokens = output_len, EOS ignored), as a benchmark's requests do;
    # otherwise EOS ends it after output_len tokens, as a model's answer does.
    ignore_eos: bool = False


@dataclass
class Session:
    """The turns still to come after the current one."""

    turns_left: int
    user_lens: list[int]
    output_lens: list[int]
    think_time_s: float


@dataclass
class WorkloadSpec:
    lengths: str = "sharegpt"  # sharegpt | alpaca | fixed
    prompt_len: int = 256  # fixed
    output_len: int = 256  # fixed
    rate: float = 1.0  # requests (sessions) per second; inf: all at time 0
    duration_s: float | None = None  # arrivals in [0, duration); or num_requests of them
    num_requests: int | None = None
    arrival: Arrival = "poisson"
    cv: float = 1.0  # gamma arrivals: coefficient of variation of the gaps
    num_prefixes: int = 0
    prefix_len: int = 0
    turns: int = 1
    think_time_s: float = 5.0
    vocab_size: int = 32000
    max_model_len: int = 2048
    seed: int = 0
    first_token_id: int = 3  # ids below are special (EOS among them) and never in prompts

    def __post_init__(self) -> None:
        if self.lengths not in (*LENGTHS, "fixed"):
            raise ValueError(f"lengths must be one of {(*LENGTHS, 'fixed')}, got {self.lengths!r}")
        if (self.duration_s is None) == (self.num_requests is None):
            raise ValueError("give exactly one of duration_s and num_requests")
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.arrival not in ("poisson", "gamma") or self.cv <= 0:
            raise ValueError("arrival must be poisson or gamma (cv > 0)")
        if self.num_prefixes < 0 or self.prefix_len < 0 or self.turns < 1:
            raise ValueError("num_prefixes, prefix_len >= 0 and turns >= 1 are required")
        if self.num_prefixes and self.prefix_len + 1 >= self.max_model_len:
            raise ValueError("prefix_len leaves no room for a request within max_model_len")


@dataclass
class WorkloadStats:
    num_requests: int = 0
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        n = max(1, len(self.prompt_tokens))
        return {
            "num_requests": self.num_requests,
            "mean_prompt_tokens": sum(self.prompt_tokens) / n,
            "mean_output_tokens": sum(self.output_tokens) / max(1, len(self.output_tokens)),
        }


class Workload:
    """Generates `SimRequest`s in arrival order; `next_turn` makes a session's next one."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self._rng = random.Random(spec.seed)
        self._np = np.random.default_rng(spec.seed)
        s = spec
        self.prefixes = [self._ids(s.prefix_len) for _ in range(s.num_prefixes)]
        self.stats = WorkloadStats()
        self._num_sessions = 0

    def _ids(self, n: int) -> list[int]:
        return self._np.integers(self.spec.first_token_id, self.spec.vocab_size, n).tolist()

    def _lengths(self, room: int) -> tuple[int, int]:
        """A (prompt, output) pair within `room` tokens."""
        s = self.spec
        if s.lengths == "fixed":
            p, o = s.prompt_len, s.output_len
        else:
            pm, ps, om, os_ = LENGTHS[s.lengths]
            p = round(self._rng.lognormvariate(math.log(pm) - ps * ps / 2, ps))
            o = round(self._rng.lognormvariate(math.log(om) - os_ * os_ / 2, os_))
        p = min(max(1, p), room - 1)
        return p, min(max(1, o), room - p)

    def _gaps(self) -> Iterator[float]:
        s = self.spec
        while True:
            if math.isinf(s.rate):
                yield 0.0
            elif s.arrival == "poisson":
                yield self._rng.expovariate(s.rate)
            else:
                k = 1.0 / (s.cv * s.cv)
                yield self._rng.gammavariate(k, 1.0 / (s.rate * k))

    def requests(self) -> Iterator[SimRequest]:
        s = self.spec
        t = 0.0
        gaps = self._gaps()
        count = 0
        while True:
            if s.num_requests is not None and count >= s.num_requests:
                return
            if s.duration_s is not None and t >= s.duration_s:
                return
            yield self._first_turn(t)
            count += 1
            t += next(gaps)

    def _first_turn(self, t: float) -> SimRequest:
        s = self.spec
        self._num_sessions += 1
        sid = self._num_sessions
        prefix: list[int] = []
        if self.prefixes:
            prefix = self.prefixes[self._rng.randrange(len(self.prefixes))]
        room = s.max_model_len - len(prefix)
        p, o = self._lengths(room)
        session = None
        if s.turns > 1:
            later = [self._lengths(room) for _ in range(s.turns - 1)]
            session = Session(
                s.turns - 1, [u for u, _ in later], [out for _, out in later], s.think_time_s
            )
        return self._made(SimRequest(f"s{sid}-t0", t, prefix + self._ids(p), o, session))

    def _made(self, r: SimRequest) -> SimRequest:
        self.stats.num_requests += 1
        self.stats.prompt_tokens.append(len(r.prompt_ids))
        self.stats.output_tokens.append(r.output_len)
        return r

    def next_turn(self, done: SimRequest, output_ids: list[int], now: float) -> SimRequest | None:
        """The session's next request after `done` ended at `now` with `output_ids`, or None
        when the session is over or its history no longer fits."""
        sess = done.session
        if sess is None or not sess.turns_left:
            return None
        i = len(sess.user_lens) - sess.turns_left
        history = done.prompt_ids + output_ids
        user, out = sess.user_lens[i], sess.output_lens[i]
        room = self.spec.max_model_len - len(history)
        if room < 2:
            return None
        user = min(user, room - 1)
        out = min(out, room - user)
        sid, turn = done.req_id.rsplit("-t", 1)
        nxt = Session(sess.turns_left - 1, sess.user_lens, sess.output_lens, sess.think_time_s)
        think = self._rng.expovariate(1.0 / sess.think_time_s) if sess.think_time_s else 0.0
        return self._made(
            SimRequest(f"{sid}-t{int(turn) + 1}", now + think, history + self._ids(user), out, nxt)
        )


def trace_requests(
    path: Path, run_index: int = 0, vocab_size: int = 32000, seed: int = 0
) -> list[SimRequest]:
    """The requests of one run of a `pagedserve bench serve --out` report: each one's send
    time, prompt and output length (prompts are random ids of the recorded length)."""
    report = json.loads(path.read_text())
    runs = report.get("runs") or []
    if not 0 <= run_index < len(runs):
        raise ValueError(f"{path}: no run {run_index} (it has {len(runs)})")
    rows = [r for r in runs[run_index].get("requests", []) if r.get("ok", True)]
    if not rows:
        raise ValueError(f"{path}: run {run_index} has no per-request data")
    if any("arrival_s" not in r for r in rows):
        raise ValueError(f"{path}: requests carry no arrival_s (re-run bench serve)")
    rng = np.random.default_rng(seed)
    return [
        SimRequest(
            f"trace-{i}",
            float(r["arrival_s"]),
            rng.integers(3, vocab_size, int(r["prompt_tokens"])).tolist(),
            max(1, int(r["output_tokens"])),
            ignore_eos=bool(report.get("ignore_eos", True)),
        )
        for i, r in enumerate(sorted(rows, key=lambda r: r["arrival_s"]))
    ]
