"""The worker's model threads, one to a core: bound where the worker is the only team on the
cores it may use, left alone where the user chose a thread count or a placement."""

from __future__ import annotations

import os
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
