"""`python -m pagedserve.child_exec PARENT_PID PROGRAM [ARG...]`: runs PROGRAM (exec, same
process) so that it gets SIGTERM when process PARENT_PID dies.

Linux's PR_SET_PDEATHSIG outlives exec. `pagedserve up` starts its children through this
rather than setting the flag between fork and exec (a `preexec_fn`): Python code in the child
of a process with threads (gRPC's) can deadlock or abort there. Elsewhere it just execs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m pagedserve.child_exec PARENT_PID PROGRAM [ARG...]", file=sys.stderr)
        return 2
    parent, program = int(argv[0]), argv[1:]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the child outlives a killed parent
    if os.getppid() != parent:
        return 1  # the parent died before the flag was set: nobody would stop this child
    # Python ignores these at startup and exec would pass that on; the program gets defaults.
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    os.execvp(program[0], program)
    return 127  # not reached: execvp raises or does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
