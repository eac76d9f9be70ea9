"""Ranks 1..N-1 of a tensor-parallel group: `python -m gpu_worker.follower RANK SIZE PORT`,
started by rank 0 (`gpu_worker.parallel.followers.Followers`) with the worker's config as the
first frame on stdin. A follower is built as rank 0 is (`gpu_worker.build.build_worker`), then
runs the plans rank 0 relays on its runner until a stop or end-of-file. It serves no RPC: rank
0 holds the Execute stream (`gpu_worker.server`)."""

from __future__ import annotations

import pickle
import sys
from typing import IO

from gpu_worker.build import build_worker
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.parallel.pipe import Kind, read_frame
from pagedserve import wire
from pagedserve.heap import freeze_heap
from pagedserve.log import get_logger
from protos.v1 import worker_pb2

log = get_logger(__name__)


def follow(rank: int, size: int, port: int, stream: IO[bytes]) -> int:
    """A follower rank's life: its config, then plans until end-of-file or a stop."""
    first = read_frame(stream)
    if first is None or first.kind != Kind.CONFIG:
        return 1
    cfg = pickle.loads(first.data)
    assert isinstance(cfg, WorkerConfig) and cfg.tensor_parallel_size == size
    worker = build_worker(cfg, rank=rank, tp_port=port)
    freeze_heap()
    return loop(worker.runner, stream)


def loop(runner: ModelRunner, stream: IO[bytes]) -> int:
    """Runs each relayed plan on `runner`, as rank 0 runs it; 0 at a stop or end-of-file (rank 0
    is gone). A plan that fails raises: the group cannot get back in step."""
    while (frame := read_frame(stream)) is not None:
        if frame.kind == Kind.STOP:
            return 0
        if frame.kind == Kind.RESET:
            runner.reset()
            continue
        msg = worker_pb2.StepPlan()
        msg.ParseFromString(frame.data)
        runner.execute(wire.plan_from_proto(msg))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(follow(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.stdin.buffer))
    except Exception as exc:  # a failed collective, a bad plan: the group cannot go on
        log.error("tensor_parallel_rank_failed", error=str(exc))
        sys.exit(1)
