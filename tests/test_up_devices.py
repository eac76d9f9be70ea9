"""`pagedserve up --workers N --device cuda` gives each worker GPUs of its own: what each worker
child is started with (its argv and CUDA_VISIBLE_DEVICES), checked without CUDA; flags that
cannot place the workers are one line before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedserve import envs
from pagedserve.cli import cluster
from pagedserve.cli.devices import DeviceError, worker_environments
from pagedserve.cli.main import build_parser


class _Started(Exception):
    """Raised once the workers are started, ending run_cluster there."""


class _Recorded:
    """Stands in for cluster.Child: records what it would start."""

    made: list[_Recorded] = []

    def __init__(self, name: str, argv: list[str], env: dict[str, str], *rest: Any) -> None:
        self.name, self.argv, self.env = name, argv, env
        _Recorded.made.append(self)

    def stop(self, timeout: float = 0) -> None:
        pass


def started_workers(
    flags: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, visible: str | None = None
) -> dict[str, tuple[list[str], str | None]]:
    """name -> (argv, CUDA_VISIBLE_DEVICES) of each worker `up FLAGS` starts."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))  # where up saves its token
    envs.reload()
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    _Recorded.made = []
    monkeypatch.setattr(cluster, "Child", _Recorded)
    monkeypatch.setattr(cluster, "stop_on_signals", lambda: None)
    monkeypatch.setattr(cluster, "_start_redis", lambda a, env: (None, None))

    def serving(address: str, child: object, timeout: float = 0) -> None:
        raise _Started

    monkeypatch.setattr(cluster, "wait_serving", serving)
    ports = ["--port", "18000", "--grpc-port", "18051", "--worker-base-port", "18061"]
    a = build_parser().parse_args(["up", "--model", "m", *ports, *flags])
    with pytest.raises(_Started):
        cluster.run_cluster(a, "/models/m")
    return {
        c.name: (c.argv, c.env.get("CUDA_VISIBLE_DEVICES"))
        for c in _Recorded.made
        if c.name.startswith("worker-")
    }


def device_flag(argv: list[str]) -> str:
    return argv[argv.index("--device") + 1]


def test_each_cuda_worker_gets_its_own_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    workers = started_workers(["--workers", "3", "--device", "cuda"], monkeypatch, tmp_path)
    assert {name: visible for name, (_, visible) in workers.items()} == {
        "worker-0": "0",
        "worker-1": "1",
        "worker-2": "2",
    }
    # Each sees its GPU as its device 0: `cuda` names it.
    assert all(device_flag(argv) == "cuda" for argv, _ in workers.values())


def test_devices_and_tensor_parallel_ranks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--devices in the order given, --tensor-parallel-size of them per worker (its rank r on
    its visible device r)."""
    flags = ["--workers", "2", "--device", "cuda", "--tensor-parallel-size", "2"]
    workers = started_workers([*flags, "--devices", "3,1,2,0"], monkeypatch, tmp_path)
    assert workers["worker-0"][1] == "3,1" and workers["worker-1"][1] == "2,0"
    # Without --devices, the GPUs `up` was given, in their order.
    workers = started_workers(flags, monkeypatch, tmp_path, visible="4,5,6,7,8")
    assert workers["worker-0"][1] == "4,5" and workers["worker-1"][1] == "6,7"
    # And through the environment, as compose or a unit file would set it.
    monkeypatch.setenv("PAGEDSERVE_DEVICES", "GPU-aa,GPU-bb")
    workers = started_workers(["--workers", "2", "--device", "cuda"], monkeypatch, tmp_path)
    assert workers["worker-0"][1] == "GPU-aa" and workers["worker-1"][1] == "GPU-bb"


def test_cpu_workers_get_no_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    workers = started_workers(["--workers", "2"], monkeypatch, tmp_path, visible="7")
    # The inherited variable is passed on unchanged, as before.
    assert [visible for _, visible in workers.values()] == ["7", "7"]
    assert all(device_flag(argv) == "cpu" for argv, _ in workers.values())


@pytest.mark.parametrize(
    "device,devices,workers,tp,visible,message",
    [
        ("cpu", "0,1", 2, 1, None, "--devices places workers on GPUs: add --device cuda"),
        ("cuda:1", None, 2, 1, None, "would put all 2 workers on one GPU"),
        ("cuda:1", "0,1", 2, 1, None, "--device cuda:1 names one GPU and --devices others"),
        ("cuda", "0,1,2", 2, 1, None, "--devices names 3 GPUs; 2 worker(s) x 1"),
        ("cuda", "0,1", 2, 2, None, "--devices names 2 GPUs; 2 worker(s) x 2"),
        ("cuda", "0,0", 2, 1, None, "GPU 0 is named twice"),
        ("cuda", "0,,1", 2, 1, None, "give GPUs as 0,1,2"),
        ("cuda", None, 3, 1, "0,1", "CUDA_VISIBLE_DEVICES=0,1 shows 2 GPUs"),
    ],
)
def test_flags_that_cannot_place_the_workers(
    device: str, devices: str | None, workers: int, tp: int, visible: str | None, message: str
) -> None:
    with pytest.raises(DeviceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        worker_environments(device, devices, workers, tp, visible)


def test_one_named_gpu_for_one_worker_is_left_as_named() -> None:
    assert worker_environments("cuda:1", None, 1, 1, None) == [{}]


def test_up_says_so_in_one_line_before_starting_anything(micro_llama: Path) -> None:
    cmd = [
        sys.executable, "-m", "pagedserve.cli", "up", "--model", str(micro_llama),
        "--workers", "2", "--device", "cuda:1",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "pagedserve: --device cuda:1 would put all 2 workers on one GPU: give --device cuda "
        "(worker i on GPU i) or --device cuda --devices 0,1,..."
    )
    assert "worker-0 |" not in out.stdout  # nothing started


def test_cpu_workers_on_one_host_split_the_default_pool(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each of N CPU workers gets 1/N of the pool one worker would take from the free memory,
    rather than all N sizing themselves from it; a given size or one worker is left alone."""
    monkeypatch.setattr(cluster, "available_bytes", lambda: 16 << 30)  # default: 4 GiB
    workers = started_workers(["--workers", "4"], monkeypatch, tmp_path)
    for argv, _ in workers.values():
        assert argv[argv.index("--kv-cache-memory") + 1] == str(1 << 30)
    one = started_workers([], monkeypatch, tmp_path)
    assert all("--kv-cache-memory" not in argv for argv, _ in one.values())
    given = started_workers(["--workers", "2", "--kv-cache-memory", "2GiB"], monkeypatch, tmp_path)
    for argv, _ in given.values():
        assert argv.count("--kv-cache-memory") == 1
        assert argv[argv.index("--kv-cache-memory") + 1] == str(2 << 30)
