"""A busy machine on demand: processes that spin on the CPU, as `stress --cpu N` does.

Tests must hold on a shared machine whose cores are taken by others. Run one beside them:

    python -m tests.cpu_hog -n 8 -- .venv/bin/python -m pytest tests/test_slow_readers.py
    python -m tests.cpu_hog -n 8 --seconds 600      # alone, until the time is up or Ctrl-C

With a command, the hog starts first, the command runs, and the hog stops when it ends; the exit
status is the command's. In Python, `with cpu_hog(8): ...` (or `with busy_machine(): ...`) does
the same, so that a test can check that what it asserts holds on a busy machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

# Each spinner is one process at the default priority, so that it takes a full share of a core
# from the processes under test, as another user's job would.
NICE = 0


def _spin(seconds: float, parent: int, started: Any) -> None:
    os.nice(NICE)
    started.release()
    end = time.monotonic() + seconds
    x = 0
    # Until the time is up or the hog is gone (killed without a chance to stop its spinners).
    while time.monotonic() < end and os.getppid() == parent:
        for _ in range(100_000):
            x = (x * 31 + 7) & 0xFFFF


@contextmanager
def cpu_hog(procs: int, seconds: float = 3600.0) -> Iterator[list[mp.Process]]:
    """`procs` spinning processes for the body of the `with` (at most `seconds`)."""
    ctx = mp.get_context("spawn")  # no copy of the caller's threads or locks
    me, started = os.getpid(), ctx.Semaphore(0)
    spinners = [
        ctx.Process(target=_spin, args=(seconds, me, started), daemon=True) for _ in range(procs)
    ]
    for p in spinners:
        p.start()
    try:
        for _ in spinners:  # the body runs on a machine already busy
            if not started.acquire(timeout=120):
                raise RuntimeError("a spinner did not start")
        yield spinners
    finally:
        for p in spinners:
            p.terminate()
        for p in spinners:
            p.join(10)


def busy_machine() -> AbstractContextManager[list[mp.Process]]:
    """Eight spinners a core beside the `with` body: on two cores, a load of 16 and more, as a
    shared CI machine has (10-27 measured under `make test`)."""
    return cpu_hog(8 * (os.cpu_count() or 1))


def load_average() -> float:
    """The one-minute load average."""
    return os.getloadavg()[0]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in args:
        i = args.index("--")
        args, command = args[:i], args[i + 1 :]
    parser = argparse.ArgumentParser(prog="python -m tests.cpu_hog", description=__doc__)
    parser.add_argument("-n", "--procs", type=int, default=2 * (os.cpu_count() or 1))
    parser.add_argument("--seconds", type=float, default=3600.0, help="without a command")
    opts = parser.parse_args(args)
    # A plain `kill` stops the spinners too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with cpu_hog(opts.procs, opts.seconds) as spinners:
        if command:
            proc = subprocess.Popen(command)
            try:
                return proc.wait()
            finally:
                if proc.poll() is None:  # the hog was stopped first: the command with it
                    proc.terminate()
                    proc.wait()
        try:
            for p in spinners:
                p.join()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
