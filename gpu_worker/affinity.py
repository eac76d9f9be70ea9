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
priority a woken gateway waited behind the model's threads for tens of milliseconds at a time
under overload (`benchmarks/overload.py`); the worker lowers its own priority
(`yield_cpu_to_others`, `--nice`) so they run first and the model gets the rest.
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


# The worker's default niceness on a CPU: weight 110 against the other processes' 1,024.
CPU_NICE = 10


def yield_cpu_to_others(nice: int) -> str | None:
    """Lowers this process's CPU priority by `nice` so that the gateway, the control plane and
    their clients on the same cores run first when they wake, and the model takes what they
    leave: every thread it has (Linux keeps a niceness per thread), hence every thread they
    start from now on (a new thread inherits its creator's), and, where this process leads a
    session of its own (`pagedserve up` starts each component so), the session's autogroup,
    since the kernel first shares the CPU between autogroups and a niceness only counts within
    one. Returns "session" or "threads" (where it applied), None for `nice` 0."""
    if nice <= 0:
        return None
    for tid in os.listdir("/proc/self/task"):
        try:
            now = os.getpriority(os.PRIO_PROCESS, int(tid))
            os.setpriority(os.PRIO_PROCESS, int(tid), min(19, now + nice))
        except OSError:  # a thread that ended meanwhile
            pass
    if os.getsid(0) == os.getpid():
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
            return "session"
        except OSError:  # a kernel without autogroups, or one that refuses
            pass
    return "threads"
