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


def test_lowered_threads_pass_their_priority_to_the_threads_they_start() -> None:
    """In a child process: a thread lowered by 3 and one it starts afterwards are at +3, a
    thread left out keeps the process's priority."""
    probe = """
import json, os, threading
from gpu_worker.affinity import lower_threads
base = os.getpriority(os.PRIO_PROCESS, 0)
go, out = threading.Event(), {}
def other():
    go.wait()
    out["other"] = os.getpriority(os.PRIO_PROCESS, 0)
t = threading.Thread(target=other)
t.start()
out["lowered"] = lower_threads([threading.get_native_id()], 3)
def child():
    out["child"] = os.getpriority(os.PRIO_PROCESS, 0)
c = threading.Thread(target=child)
c.start()
c.join()
go.set()
t.join()
out["self"] = os.getpriority(os.PRIO_PROCESS, 0)
print(json.dumps({k: v - base if k != "lowered" else v for k, v in out.items()}))
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"lowered": 1, "self": 3, "child": 3, "other": 0}


def _thread_nices(pid: int) -> dict[str, list[int]]:
    """Each thread's niceness, by name: gRPC's are named, the model's and Python's are not."""
    out: dict[str, list[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            out.setdefault(name, []).append(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except OSError:  # a thread that ended meanwhile
            pass
    return out


@pytest.mark.parametrize("flag, lowered", [([], 10), (["--nice", "0"], 0), (["--nice", "3"], 3)])
def test_a_cpu_workers_model_threads_yield_to_the_other_services(
    spawn: Callable[..., ServerProcess], micro_llama: Path, flag: list[str], lowered: int
) -> None:
    """The model thread and its team run below everything else; the threads that answer the
    control plane (gRPC's, and the Python threads of its handlers) keep the usual priority."""
    port = free_port()
    args = worker_cli_args(micro_llama, port, 64, 0, "float32") + flag
    w = spawn("worker", *args, ready_address=f"127.0.0.1:{port}", env={"OMP_NUM_THREADS": None})
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    expected = min(19, ours + lowered)
    assert os.getpriority(os.PRIO_PROCESS, w.proc.pid) == expected  # the model's thread
    nices = _thread_nices(w.proc.pid)
    grpc = [n for name, ns in nices.items() if name != "python" for n in ns]
    assert grpc and set(grpc) == {ours}, nices
    if CPUS and len(CPUS) >= 2:  # its OpenMP team: one more thread per core, lowered too
        assert nices["python"].count(expected) >= 2, nices
    line = next((x for x in w.output().splitlines() if '"cpu_priority_lowered"' in x), None)
    assert (line is not None) == (lowered > 0)
