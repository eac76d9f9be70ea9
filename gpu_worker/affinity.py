"""The worker's OpenMP threads, one to a core, and its CPU priority below the other services'.

On a machine it shares with the control plane, the gateway and its clients, a worker whose
threads float lets the scheduler stack two of them on one core or move one mid-step, and every
parallel region waits for the slowest. Bound one to a core (libgomp's OMP_PROC_BIND=close,
OMP_PLACES=cores, as vLLM's CPU backend binds its own), the model's threads stay put and the
other processes take what is left. libgomp reads these when torch loads it, so the worker sets
them before it imports torch. The threads the worker starts for other work (gRPC, grammar
compilation) get the whole machine back (`unbind_this_thread`). docs/benchmarks.md has the
measurements.

The worker is the one process that would take every cycle it can get; the gateway and the
control plane need little, but at once, and a request waits for them at each hop. With equal
priority a woken control plane waited behind the model's threads for tens of milliseconds at
a time under overload (`benchmarks/overload.py`). The worker lowers the priority of its model
threads (`lower_threads`, `--nice`) so the others run first and the model gets the rest; its
gRPC threads, which answer the control plane's health probes, keep theirs: a worker lowered
whole went unanswered for 10 s while another server started beside it, and was taken for
lost. A niceness counts among the threads of one autogroup (one session, where the kernel
groups by session), so `pagedserve up` keeps its children in its own session.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# Any of these set by the user: their placement stands.
PLACEMENT_VARS = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")

_whole: set[int] | None = None


def bind_threads_to_cores(
    device: str,
    num_threads: int | None,
    tensor_parallel_size: int,
    env: MutableMapping[str, str] = os.environ,
) -> bool:
    """Binds the model's threads (through `env`, before torch is imported) where the worker is
    the only team on the cores it may use: on the CPU, one rank, and its thread count left to
    the default of one per core. A thread count of the user's (`--num-threads`,
    OMP_NUM_THREADS), a tensor-parallel group (ranks share the machine) or a placement of the
    user's leaves the threads as they are. Returns whether it bound them."""
    global _whole
    if device != "cpu" or tensor_parallel_size != 1 or num_threads is not None:
        return False
    if "OMP_NUM_THREADS" in env or any(name in env for name in PLACEMENT_VARS):
        return False
    _whole = os.sched_getaffinity(0)
    env["OMP_PROC_BIND"] = "close"
    env["OMP_PLACES"] = "cores"
    return True


def unbind_this_thread() -> None:
    """For a thread that is not the model's (a thread pool's initializer): the CPUs the process
    had before its threads were bound. libgomp binds the thread that loads it to the first
    core, and threads started from that one afterwards inherit it; a no-op where nothing was
    bound."""
    if _whole is not None:
        os.sched_setaffinity(0, _whole)


def is_bound() -> bool:
    """Whether `bind_threads_to_cores` bound the model's threads in this process."""
    return _whole is not None


def other_cores(count: int) -> list[int]:
    """`count` CPUs for the CPU team's helpers: the bound cores after the calling thread's own
    (it is bound to one), or -1 each (unbound) where nothing was bound."""
    mine = os.sched_getaffinity(0)
    if _whole is None or len(mine) != 1:
        return [-1] * count
    rest = sorted(_whole - mine)
    return (rest + [-1] * count)[:count]


# The worker's default niceness on a CPU: its model threads weigh 110 against the 1,024 of
# every other thread of the machine's processes (its own gRPC threads included).
CPU_NICE = 10


def thread_ids() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def lower_threads(tids: list[int], nice: int) -> int:
    """Lowers the CPU priority of these threads of this process by `nice` (a thread started by
    one of them afterwards inherits it); returns how many it lowered."""
    done = 0
    for tid in tids:
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + nice))
            done += 1
        except OSError:  # a thread that ended meanwhile
            pass
    return done
