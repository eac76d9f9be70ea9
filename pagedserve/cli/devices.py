"""Which GPUs each worker of `pagedserve up` runs on.

`--device cuda` with `--workers N` gives each worker its own GPUs through CUDA_VISIBLE_DEVICES
in its environment: worker i sees the i-th run of `--tensor-parallel-size` GPUs of the pool, as
its devices 0..T-1 (a tensor-parallel worker puts rank r on visible device r). The pool is
`--devices` where given, else the CUDA_VISIBLE_DEVICES `up` itself was started with, else GPUs
0..N*T-1. Every process's `cuda` is then its own GPU, and no worker's memory budget
(`--gpu-memory-utilization`, a fraction of its device) counts on a GPU another worker fills.

`up` never imports torch (docs/architecture.md, invariants), so it does not count the GPUs: a
worker given one that is not there fails at start with CUDA's own error.
"""

from __future__ import annotations

import argparse

VISIBLE = "CUDA_VISIBLE_DEVICES"


class DeviceError(ValueError):
    """The flags cannot place the workers on GPUs; the message names the flag to change."""


def parse_devices(text: str) -> list[str]:
    """`0,1,2` (indices, or GPU UUIDs as CUDA_VISIBLE_DEVICES takes them) -> ["0", "1", "2"]."""
    ids = [d.strip() for d in text.split(",")]
    if not text.strip() or any(not d for d in ids):
        raise DeviceError(f"--devices {text!r}: give GPUs as 0,1,2 (indices or UUIDs)")
    twice = sorted({d for d in ids if ids.count(d) > 1})
    if twice:
        raise DeviceError(
            f"--devices {text}: GPU {', '.join(twice)} is named twice; each worker gets GPUs "
            "of its own"
        )
    return ids


def worker_environments(
    device: str, devices: str | None, workers: int, tp_size: int, inherited: str | None
) -> list[dict[str, str]]:
    """What to add to each worker's environment (worker i's at index i): nothing on CPU or on
    one named GPU (`cuda:K`), else its CUDA_VISIBLE_DEVICES. `inherited` is the
    CUDA_VISIBLE_DEVICES `up` runs with. Raises DeviceError for flags that cannot work."""
    if device == "cpu" or not device.startswith("cuda"):
        if devices is not None:
            raise DeviceError("--devices places workers on GPUs: add --device cuda")
        return [{} for _ in range(workers)]
    if device != "cuda":  # cuda:K names one GPU
        if devices is not None:
            raise DeviceError(
                f"--device {device} names one GPU and --devices others: give --device cuda "
                "with --devices"
            )
        if workers > 1:
            raise DeviceError(
                f"--device {device} would put all {workers} workers on one GPU: give "
                f"--device cuda (worker i on GPU i) or --device cuda --devices 0,1,..."
            )
        return [{}]
    need = workers * tp_size
    per = f"{workers} worker(s) x {tp_size} tensor-parallel rank(s)"
    if devices is not None:
        pool = parse_devices(devices)
        if len(pool) != need:
            raise DeviceError(f"--devices names {len(pool)} GPUs; {per} need {need}")
    elif inherited is not None and inherited.strip():
        pool = [d.strip() for d in inherited.split(",") if d.strip()]
        if len(pool) < need:
            raise DeviceError(
                f"{VISIBLE}={inherited} shows {len(pool)} GPUs; {per} need {need} (give "
                "--devices, or fewer --workers)"
            )
    else:
        pool = [str(i) for i in range(need)]
    return [{VISIBLE: ",".join(pool[i * tp_size : (i + 1) * tp_size])} for i in range(workers)]


def from_args(a: argparse.Namespace, inherited: str | None) -> list[dict[str, str]]:
    """worker_environments for `up`'s parsed flags."""
    return worker_environments(a.device, a.devices, a.workers, a.tensor_parallel_size, inherited)
