"""The worker's model threads, one to a core: bound where the worker is the only team on the
cores it may use, left alone where the user chose a thread count or a placement. And its CPU
priority, below the other services' on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_worker.affinity import bind_threads_to_cores
from tests.procs import ServerProcess, free_port
from tests.stack import worker_cli_args

CPUS = os.sched_getaffinity(0)


def _thread_cpus(pid: int) -> dict[int, set[int]]:
    """Each thread of `pid` -> the CPUs it may run on."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # a thread that ended meanwhile
            pass
    return out


@pytest.mark.parametrize(
    "kw, env",
    [
        ({"device": "cuda", "num_threads": None, "tensor_parallel_size": 1}, {}),
        ({"device": "cpu", "num_threads": 2, "tensor_parallel_size": 1}, {}),
        ({"device": "cpu", "num_threads": None, "tensor_parallel_size": 2}, {}),
        (
            {"device": "cpu", "num_threads": None, "tensor_parallel_size": 1},
            {"OMP_NUM_THREADS": "2"},
        ),
        (
            {"device": "cpu", "num_threads": None, "tensor_parallel_size": 1},
            {"OMP_PLACES": "threads"},
        ),
        (
            {"device": "cpu", "num_threads": None, "tensor_parallel_size": 1},
            {"GOMP_CPU_AFFINITY": "0"},
        ),
    ],
)
def test_the_users_choices_leave_the_threads_unbound(
    kw: dict[str, object], env: dict[str, str]
) -> None:
    before = dict(env)
    assert not bind_threads_to_cores(env=env, **kw)  # type: ignore[arg-type]
    assert env == before


def test_the_default_binds_through_the_environment() -> None:
    env: dict[str, str] = {}
    assert bind_threads_to_cores("cpu", None, 1, env)
    assert env == {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}


@pytest.mark.skipif(len(CPUS) < 2, reason="one core: nothing to bind apart")
def test_a_default_worker_keeps_a_thread_on_each_core_and_frees_its_other_threads(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    port = free_port()
    args = worker_cli_args(micro_llama, port, 64, 0, "float32")
    # The tests' default of one thread is a thread count of the user's: take it out.
    w = spawn("worker", *args, ready_address=f"127.0.0.1:{port}", env={"OMP_NUM_THREADS": None})
    assert '"threads_bound"' in w.output()
    threads = _thread_cpus(w.proc.pid)
    main = threads[w.proc.pid]
    assert len(main) == 1  # the model thread: OpenMP's thread 0, on the first core
    pinned = {min(c) for c in threads.values() if len(c) == 1}
    assert len(pinned) >= 2, threads  # and its team's other thread on another core
    assert any(c == CPUS for c in threads.values()), threads  # gRPC's pool: the whole machine


def test_a_worker_with_a_thread_count_is_not_bound(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    port = free_port()
    w = spawn(
        "worker",
        *worker_cli_args(micro_llama, port, 64, 0, "float32"),
        ready_address=f"127.0.0.1:{port}",
    )
    assert '"threads_bound"' not in w.output()
    assert all(c == CPUS for c in _thread_cpus(w.proc.pid).values())


# -- CPU priority -------------------------------------------------------------------------------

_PROBE = """
import json, os, sys, threading
from gpu_worker.affinity import yield_cpu_to_others
before = os.getpriority(os.PRIO_PROCESS, 0)
go, older = threading.Event(), {}
def wait():
    go.wait()
    older.update(nice=os.getpriority(os.PRIO_PROCESS, 0))
first = threading.Thread(target=wait)
first.start()
scope = yield_cpu_to_others(int(sys.argv[1]))
go.set()
first.join()
started = {}
t = threading.Thread(target=lambda: started.update(nice=os.getpriority(os.PRIO_PROCESS, 0)))
t.start()
t.join()
with open("/proc/self/autogroup") as f:
    group = f.read().split()[-1]
print(json.dumps({"before": before, "after": os.getpriority(os.PRIO_PROCESS, 0),
                  "thread": started["nice"], "older": older["nice"], "scope": scope,
                  "group": int(group)}))
"""

HAS_AUTOGROUP = os.path.exists("/proc/self/autogroup")


def _probe(nice: int, new_session: bool) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(nice)],
        capture_output=True, text=True, timeout=60, start_new_session=new_session,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


@pytest.mark.skipif(not HAS_AUTOGROUP, reason="a kernel without autogroups")
def test_a_session_leader_lowers_its_threads_and_its_sessions_autogroup() -> None:
    got = _probe(7, new_session=True)
    assert got["scope"] == "session"
    assert got["after"] == got["thread"] == got["older"] == min(19, int(str(got["before"])) + 7)
    assert got["group"] == 7


@pytest.mark.skipif(not HAS_AUTOGROUP, reason="a kernel without autogroups")
def test_a_process_in_anothers_session_leaves_the_sessions_autogroup_alone() -> None:
    with open("/proc/self/autogroup") as f:
        ours = int(f.read().split()[-1])
    got = _probe(7, new_session=False)
    assert got["scope"] == "threads"
    assert got["after"] == got["thread"] == got["older"] == min(19, int(str(got["before"])) + 7)
    assert got["group"] == ours


def test_nice_zero_changes_nothing() -> None:
    got = _probe(0, new_session=True)
    assert got["scope"] is None
    assert got["after"] == got["thread"] == got["older"] == got["before"]


def _thread_nices(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except OSError:  # a thread that ended meanwhile
            pass
    return out


@pytest.mark.parametrize("flag, lowered", [([], 10), (["--nice", "0"], 0), (["--nice", "3"], 3)])
def test_a_cpu_worker_yields_to_the_other_services_unless_told_not_to(
    spawn: Callable[..., ServerProcess], micro_llama: Path, flag: list[str], lowered: int
) -> None:
    port = free_port()
    args = worker_cli_args(micro_llama, port, 64, 0, "float32") + flag
    w = spawn("worker", *args, ready_address=f"127.0.0.1:{port}")
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    expected = min(19, ours + lowered)
    assert os.getpriority(os.PRIO_PROCESS, w.proc.pid) == expected  # the model's thread
    # And every other thread: those it had (numpy's BLAS pool) and those started after (OpenMP's,
    # gRPC's).
    assert set(_thread_nices(w.proc.pid)) == {expected}
    assert ('"cpu_priority_lowered"' in w.output()) == (lowered > 0)
