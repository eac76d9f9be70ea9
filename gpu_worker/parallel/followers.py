"""Rank 0's handle on ranks 1..N-1 of its tensor-parallel group: it starts their processes,
sends each plan down their pipes, and ends with any of them."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading

from gpu_worker.config import WorkerConfig
from gpu_worker.parallel.pipe import Kind, encode
from pagedserve.log import get_logger

log = get_logger(__name__)


class Followers:
    """Rank 0's handle on ranks 1..N-1: their processes and the pipes plans go down."""

    def __init__(self, cfg: WorkerConfig, size: int, port: int) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._stopping = False
        config = encode(Kind.CONFIG, pickle.dumps(cfg))
        for rank in range(1, size):
            cmd = [
                sys.executable, "-m", "pagedserve.child_exec", str(os.getpid()),
                sys.executable, "-m", "gpu_worker.follower", str(rank), str(size), str(port),
            ]  # fmt: skip
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(config)
            proc.stdin.flush()
            self._procs.append(proc)

    def watch(self) -> None:
        """From now on, a rank that exits ends this process too: the group cannot compute
        without it, and the control plane must see the worker gone, not hung."""
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(target=self._wait, args=(rank, proc), daemon=True).start()

    def _wait(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._stopping:
            return
        log.error("tensor_parallel_rank_exited", rank=rank, exit_code=code)
        os._exit(1)

    def send_plan(self, data: bytes) -> None:
        self._send(Kind.PLAN, data)

    def send_reset(self) -> None:
        self._send(Kind.RESET, b"")

    def stop(self) -> None:
        self._stopping = True
        try:
            self._send(Kind.STOP, b"")
        except OSError:
            pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def _send(self, kind: Kind, data: bytes) -> None:
        frame = encode(kind, data)
        with self._lock:
            for proc in self._procs:
                assert proc.stdin is not None
                proc.stdin.write(frame)
                proc.stdin.flush()
