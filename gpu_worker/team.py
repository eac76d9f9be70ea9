"""How many of the worker's threads each CPU step runs on, chosen by measuring.

On a machine the worker shares with the control plane, the gateway and their clients, every
thread of the model's OpenMP team is bound to a core (`gpu_worker.affinity`), and every
parallel region ends at a barrier. When another process takes one of those cores, the team's
other threads spin at the barrier until it gives the core back: the step stalls, and the other
process gets none of the waiting threads' time. Where the edge's work per token is large beside
the model's (a small model streamed to many clients), a team one thread smaller leaves the
edge a core and the steps run uninterrupted; where the model dominates (a larger model, long
prompts, no one streaming), the whole team is faster. Which one wins depends on the model, the
load and the machine, so the worker measures it as it serves. It measures decode steps: a
step that carries prompt tokens is mostly large matrix products, which the whole team computes
well apart (one such step on the smaller team took 1.6-2.8 times as long in every measurement,
edge busy or not), and it is long, so that probing it would hold up every request waiting for
its first token; those steps run on the whole team.

    probe:   PAIRS pairs of windows of WINDOW decode steps, one window per team size, the
             order alternating (A B, B A, ...); a window's rate is its rows over its time
    decide:  the smaller team if the median of the pairs' log rate ratios favours it by more
             than MARGIN, the whole team otherwise; a pair whose windows' rows differ by more
             than COMPARABLE times is left out, and with fewer than MIN_PAIRS left the choice
             stands; once the pairs show the smaller team clearly slower (CLEAR_LOSS), the
             probe ends there
    serve:   that size for decode steps for EXPLOIT_FACTOR times the probe's time (at
             least EXPLOIT_S), then probe again; the first probe comes after EXPLOIT_S on
             the whole team. Each probe in a row that ends in a clear loss doubles the
             serving time, up to MAX_BACKOFF times: on a compute-bound model every probe
             finds the same, and each costs its steps on the smaller team

A step's time runs from its start to the next step's start: the wait for the next plan counts,
since a control plane short of CPU sends it late, but a gap longer than the step itself is the
load's, not the team's, and counts as the step's own length. Probing costs little: about 5% of
the time, half of it on the losing size, and less where the smaller team keeps losing clearly.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from pagedserve.log import get_logger

log = get_logger(__name__)

WINDOW = 4
PAIRS = 6
MIN_PAIRS = 3
COMPARABLE = 1.25
MARGIN = 0.03
# The probe ends once every pair so far shows the smaller team slower than this: one pair at
# less than 0.7 times the whole team's rate, two or more at less than 0.85.
CLEAR_LOSS = (math.log(0.7), math.log(0.85))
EXPLOIT_FACTOR = 20
EXPLOIT_S = 1.0
MAX_BACKOFF = 8


class _Probe:
    """The measured choice for decode steps."""

    def __init__(self, small: int, whole: int) -> None:
        self.small, self.whole = small, whole
        self.chosen = whole
        self.schedule: list[tuple[int, int]] = []  # (team size, window) of the probe's steps
        self.windows: list[list[float]] = []  # [work, seconds, steps] per window
        self.serve_until: float | None = None  # probe once the clock passes it
        self.count = 0
        self.backoff = 1  # the serving time's multiple: doubled by each clear loss in a row

    def next_size(self, now: float) -> tuple[int, int]:
        """The next step's team size and window (-1: not probing)."""
        if self.serve_until is None:  # the first step: serve a while before the first probe
            self.serve_until = now + EXPLOIT_S
        if not self.schedule and not self.windows and now >= self.serve_until:
            self._start()
        if self.schedule:
            return self.schedule.pop(0)
        return self.chosen, -1

    def book(self, window: int, work: float, seconds: float, now: float) -> None:
        if window >= len(self.windows):  # a window of a probe that ended early
            return
        counts = self.windows[window]
        counts[0] += work
        counts[1] += seconds
        counts[2] += 1
        if window % 2 == 0 or counts[2] < WINDOW:
            return
        # A pair is complete: the probe ends after its last pair, or sooner once the smaller
        # team has clearly lost every pair so far (on a model the whole team computes far
        # faster, each probe step on the smaller one costs much).
        ratios = self._ratios(window // 2 + 1)
        lost = bool(ratios) and max(ratios) < CLEAR_LOSS[min(len(ratios), 2) - 1]
        if lost or window == len(self.windows) - 1:
            self.schedule = []
            self._decide(ratios, now, lost)

    def _ratios(self, pairs: int) -> list[float]:
        """log(rate of the smaller team / rate of the whole) of the first `pairs` pairs that
        compare like with like: a pair whose windows' rows differ by more than COMPARABLE
        times (a batch filling up or draining) is left out."""
        ratios = []
        for pair in range(pairs):
            a, b = self.windows[2 * pair], self.windows[2 * pair + 1]
            small, whole = (a, b) if pair % 2 == 0 else (b, a)
            low, high = sorted((small[0], whole[0]))
            if low > 0 and high <= COMPARABLE * low:
                ratios.append(math.log((small[0] / small[1]) / (whole[0] / whole[1])))
        return ratios

    def _start(self) -> None:
        for pair in range(PAIRS):
            order = (self.small, self.whole) if pair % 2 == 0 else (self.whole, self.small)
            for size in order:
                self.schedule += [(size, len(self.windows))] * WINDOW
                self.windows.append([0.0, 0.0, 0])
        self.count += 1

    def _decide(self, ratios: list[float], now: float, lost: bool) -> None:
        """The median of the pairs' ratios; with fewer than MIN_PAIRS (and no clear loss),
        the choice stands."""
        probe_s = sum(seconds for _, seconds, _ in self.windows)
        self.windows = []
        previous = self.chosen
        gain = statistics.median(ratios) if ratios else 0.0
        if lost or len(ratios) >= MIN_PAIRS:
            self.chosen = self.small if gain > MARGIN else self.whole
        self.backoff = min(2 * self.backoff, MAX_BACKOFF) if lost else 1
        self.serve_until = now + max(EXPLOIT_S, EXPLOIT_FACTOR * self.backoff * probe_s)
        log.debug(
            "threads_probed",
            threads=self.chosen,
            measured_gain=round(math.expm1(gain), 3),
            pairs=[round(r, 3) for r in ratios],
            probe_s=round(probe_s, 3),
            serve_s=round(self.serve_until - now, 3),
        )
        if self.chosen != previous:
            log.info(
                "threads_resized",
                threads=self.chosen,
                of=self.whole,
                measured_gain=round(math.expm1(gain), 3),
            )


class TeamSizer:
    """Picks the team size of each step (`begin`) from the decode steps it has timed (`end`);
    on the model thread only. `sizes` is (smaller, whole); `set_threads` applies a size
    (torch's `set_num_threads`, which oneDNN, torch's kernels and ours follow)."""

    def __init__(
        self,
        sizes: tuple[int, int],
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.small, self.whole = sizes
        self._set_threads = set_threads
        self._clock = clock
        self.decode = _Probe(self.small, self.whole)
        self._applied = self.whole
        # The step begun last: its start, window (-1: none) and rows; then, once ended, its end.
        self._open: tuple[float, int, int] | None = None
        self._last: tuple[float, int, int, float] | None = None

    @contextmanager
    def step(self, rows: int, tokens: int) -> Iterator[int]:
        """Around a step of `rows` requests and `tokens` tokens: sets its team size (yielded)
        and times it, also when it fails."""
        size = self.begin(rows, tokens)
        try:
            yield size
        finally:
            self.end()

    def begin(self, rows: int, tokens: int) -> int:
        """Before a step of `rows` requests and `tokens` tokens: sets and returns its team size;
        books the previous step, now that its time is known."""
        now = self._clock()
        self._book(now)
        size, window = self.whole, -1
        if tokens <= rows:  # a decode step; one with prompt tokens runs on the whole team
            size, window = self.decode.next_size(now)
        if size != self._applied:
            self._set_threads(size)
            self._applied = size
        self._open = (now, window, rows)
        return size

    def end(self) -> None:
        """After the step begun last."""
        if self._open is not None:
            self._last = (*self._open, self._clock())
            self._open = None

    def _book(self, now: float) -> None:
        """The previous step into its window: from its start to `now`, a gap past its own
        length counting as that length."""
        if self._last is None:
            return
        start, window, rows, end = self._last
        self._last = None
        if window >= 0:
            busy = end - start
            self.decode.book(window, rows, busy + min(now - end, busy), now)
