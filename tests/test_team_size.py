"""The worker's team size per decode step, measured between the whole team and one thread
fewer (gpu_worker.team), with a clock that advances by what each size is made to cost."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_worker import team
from gpu_worker.team import TeamSizer
from tests.procs import ServerProcess, free_port
from tests.stack import worker_cli_args


class Machine:
    """A fake clock and the thread counts set: a step of `rows` rows takes `cost(size, rows)`
    seconds on a team of `size`, then the next plan comes after `gap` seconds."""

    def __init__(self, cost: Callable[[int, int], float], gap: float = 0.0) -> None:
        self.now = 0.0
        self.cost = cost
        self.gap = gap
        self.applied: list[int] = []
        self.sizer = TeamSizer((1, 2), set_threads=self.applied.append, clock=lambda: self.now)
        # A worker that has served a while: its first probe is due (see the test below).
        self.sizer.decode.serve_until = 0.0

    def step(self, rows: int = 64, tokens: int | None = None) -> int:
        tokens = rows if tokens is None else tokens
        size = self.sizer.begin(rows, tokens)
        self.now += self.cost(size, rows)
        self.sizer.end()
        self.now += self.gap
        return size

    def run(self, steps: int, **kw: int) -> list[int]:
        return [self.step(**kw) for _ in range(steps)]


PROBE_STEPS = team.PAIRS * 2 * team.WINDOW


def test_a_probe_alternates_the_sizes_and_keeps_the_faster_smaller_team() -> None:
    m = Machine(lambda size, rows: 0.010 if size == 1 else 0.013)
    sizes = m.run(PROBE_STEPS)
    # Pairs of windows, the order alternating: small whole, whole small, ...
    assert sizes[: 4 * team.WINDOW] == [1] * 4 + [2] * 8 + [1] * 4
    assert sizes.count(1) == sizes.count(2) == PROBE_STEPS // 2
    assert m.run(50) == [1] * 50
    assert m.sizer.decode.chosen == 1
    assert m.applied[-1] == 1


def test_a_new_worker_serves_on_the_whole_team_before_its_first_probe() -> None:
    m = Machine(lambda size, rows: 0.010 if size == 1 else 0.013)
    m.sizer.decode.serve_until = None
    first = int(team.EXPLOIT_S / 0.013)
    assert m.run(first) == [2] * first
    assert m.sizer.decode.count == 0
    assert 1 in m.run(10)
    assert m.sizer.decode.count == 1


def test_the_whole_team_stays_when_it_is_faster_or_as_fast() -> None:
    for small_cost in (0.020, 0.0101):  # slower; 1% faster is within the margin
        m = Machine(lambda size, rows, c=small_cost: c if size == 1 else 0.010)
        m.run(PROBE_STEPS)
        assert m.run(30) == [2] * 30


def test_steps_with_prompt_tokens_run_on_the_whole_team_unmeasured() -> None:
    def cost(size: int, rows: int) -> float:
        if rows == 64:  # decode
            return 0.010 if size == 1 else 0.013
        return 0.500 if size == 1 else 0.080

    m = Machine(cost)
    sizes = []
    for i in range(PROBE_STEPS * 2):
        if i % 3 == 0:
            # A prompt step, slow on the small team: were it booked, the small team would lose.
            assert m.step(rows=8, tokens=1000) == 2
        else:
            sizes.append(m.step())
    assert sizes[-10:] == [1] * 10


def test_an_idle_gap_counts_no_more_than_the_step_itself() -> None:
    # The small team is faster, and the load leaves long gaps between steps: the gaps, the
    # same for both sizes, must not drown the difference.
    m = Machine(lambda size, rows: 0.010 if size == 1 else 0.014, gap=5.0)
    m.run(PROBE_STEPS + 1)  # a step is booked when the next one begins
    assert m.sizer.decode.chosen == 1


def test_a_late_plan_counts_against_the_size_that_made_it_late() -> None:
    # Equal step times, but after a whole-team step the next plan comes 4 ms late (the
    # control plane was short of CPU): the smaller team serves more tokens a second.
    class Late(Machine):
        def step(self, rows: int = 64, tokens: int | None = None) -> int:
            size = super().step(rows, tokens)
            self.now += 0.004 if size == 2 else 0.0
            return size

    m = Late(lambda size, rows: 0.010)
    m.run(PROBE_STEPS + 1)
    assert m.sizer.decode.chosen == 1


def test_it_probes_again_and_follows_a_change_in_the_load() -> None:
    costs = {1: 0.010, 2: 0.013}
    m = Machine(lambda size, rows: costs[size])
    m.run(PROBE_STEPS + 1)
    assert m.sizer.decode.chosen == 1
    costs[1] = 0.020  # the edge went quiet: the whole team wins now
    probe_s = PROBE_STEPS * 0.0115
    serve_s = max(team.EXPLOIT_S, team.EXPLOIT_FACTOR * probe_s)
    served = m.run(int(serve_s / 0.020) - 2)
    assert set(served) == {1}  # no probe before the serving time is over
    m.run(PROBE_STEPS + 10)
    assert m.sizer.decode.chosen == 2
    assert m.sizer.decode.count == 2


def test_a_probe_over_a_batch_that_fills_up_leaves_the_choice_as_it_was() -> None:
    m = Machine(lambda size, rows: 0.010 if size == 1 else 0.013)
    # Every window's rows twice the previous one's: no pair compares like with like.
    rows = 1
    for i in range(PROBE_STEPS):
        if i % team.WINDOW == 0:
            rows *= 2
        m.step(rows=rows)
    assert m.sizer.decode.chosen == 2
    assert m.sizer.decode.count == 1


@pytest.mark.parametrize("flag, adaptive", [((), True), (("--no-adaptive-threads",), False)])
def test_a_default_worker_sizes_its_team_unless_told_not_to(
    spawn: Callable[..., ServerProcess], micro_llama: Path, flag: tuple[str, ...], adaptive: bool
) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: one team size")
    port = free_port()
    args = [*worker_cli_args(micro_llama, port, 64, 0, "float32"), *flag]
    # The OpenMP team's case: a float32 worker would otherwise run the CPU team, which has no
    # size to choose (tests/test_cpu_team.py).
    env = {"OMP_NUM_THREADS": None, "PAGEDSERVE_CPU_TEAM": "0"}
    w = spawn("worker", *args, ready_address=f"127.0.0.1:{port}", env=env)
    assert ('"threads_adaptive"' in w.output()) is adaptive


def test_a_probe_ends_early_where_the_smaller_team_clearly_loses() -> None:
    m = Machine(lambda size, rows: 0.100 if size == 1 else 0.060)
    sizes = m.run(2 * 2 * team.WINDOW + 1)  # two pairs, and the step that books the last
    assert m.sizer.decode.chosen == 2
    assert sizes[-1] == 2
    assert m.run(40) == [2] * 40


def test_clear_losses_in_a_row_probe_less_often_until_one_does_not() -> None:
    costs = {1: 0.100, 2: 0.060}
    m = Machine(lambda size, rows: costs[size])
    probe = m.sizer.decode
    pair_s = team.WINDOW * (costs[1] + costs[2])  # a probe that stops after its first pair
    serve = []
    for _ in range(5):
        count = probe.count
        while probe.count == count or probe.windows:  # until the next probe has decided
            m.step()
        serve.append(round((probe.serve_until - m.now) / pair_s))
    f = team.EXPLOIT_FACTOR
    assert serve == [min(2**i, team.MAX_BACKOFF) * f for i in range(1, 6)]
    assert serve == [2 * f, 4 * f, 8 * f, 8 * f, 8 * f]
    costs[1] = 0.050  # now the smaller team wins: back to the first pace
    m.now = probe.serve_until
    m.run(PROBE_STEPS + 1)
    assert probe.backoff == 1 and probe.chosen == 1


def test_a_step_that_fails_is_timed_all_the_same() -> None:
    m = Machine(lambda size, rows: 0.010 if size == 1 else 0.013)
    for _ in range(PROBE_STEPS):
        try:
            with m.sizer.step(64, 64) as size:
                m.now += m.cost(size, 64)
                raise ValueError("a bad plan")
        except ValueError:
            pass
    m.step()
    assert m.sizer.decode.chosen == 1
