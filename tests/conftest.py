"""Shared fixtures: free ports, real server processes, locally made checkpoints."""

from __future__ import annotations

import os

# Kernel modules read this at import time; set it before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One OpenMP thread in each test process and in every process it starts (set before torch is
# imported). `make test` runs three test processes and their servers on two cores: a second
# thread per process only waits at each parallel region for a core, and the oracle's
# float64 forward passes ran several times slower with it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Workers the tests start skip the startup warm-up of the CPU projection kernels: it runs every
# projection at each batch size up to 128 (7 s of CPU for SmolLM2 in float32, at every start),
# so that a server's first steps are not slower than the rest; no test measures those. A row
# count is built when first used instead (tests/test_models.py checks the warm-up itself).
os.environ.setdefault("PAGEDSERVE_WARMUP_BATCH_SIZE", "0")

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from pagedserve import envs  # noqa: E402
from tests.procs import ServerProcess, free_port  # noqa: E402

# The modules that take longest, longest first (seconds summed over their tests on 2 cores).
# `make test` hands modules to its test processes in collection order, one at a time as each
# process runs short of work (pytest-xdist's loadscope without reordering): started first, the
# long ones end beside the many short ones instead of after them.
LONGEST_FIRST = (
    "test_smollm2.py",  # ~130 s: float64 SmolLM2 against transformers
    "test_structured_output.py",  # ~150 s
    "test_bf16.py",  # ~120 s
    "test_e2e_greedy.py",  # ~110 s
    "test_soak.py",  # ~85 s: the one-minute soak
    "test_tensor_parallel.py",  # ~80 s
    "test_grpc_security.py",
    "test_cli_errors.py",
    "test_gateway_schema.py",
    "test_sharing_benchmarks.py",
    "test_beam_search.py",
    "test_worker_restart.py",
    "test_gateway_structured.py",
    "test_beam_benchmark.py",
    "test_cli.py",
    "test_bench_offline.py",
    "test_readme.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep order


# Models small enough that the transformers oracle and our stack both run fast on 2 cores.
MICRO: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
}


@pytest.fixture(autouse=True)
def _fresh_switches() -> Iterator[None]:
    """A test that changes a PAGEDSERVE_* switch in-process calls `envs.reload()`; after it
    (and monkeypatch's undo) the switches are parsed again, so the next test sees its own."""
    yield
    envs.reload()


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make_checkpoint(arch, seed=0, **overrides) -> dir; cached for the session."""
    from gpu_worker.model_init import write_random_checkpoint

    cache: dict[str, Path] = {}

    def make(arch: str = "llama", seed: int = 0, preset: str = "tiny", **overrides: Any) -> Path:
        key = repr((arch, seed, preset, sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{arch}")
            cache[key] = write_random_checkpoint(
                out, preset=preset, arch=arch, seed=seed, overrides=overrides or None
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def micro_llama(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", **MICRO)


@pytest.fixture
def port() -> int:
    return free_port()


def _spawner() -> Iterator[Callable[..., ServerProcess]]:
    procs: list[ServerProcess] = []

    def start(name: str, *args: str, ready_address: str, **kw: Any) -> ServerProcess:
        p = ServerProcess(name, list(args), ready_address, **kw)
        procs.append(p)
        p.wait_ready()
        return p

    yield start
    for p in reversed(procs):
        p.stop()


@pytest.fixture
def spawn() -> Iterator[Callable[..., ServerProcess]]:
    """spawn(name, *cli_args, ready_address=...) starts `pagedserve ...`; all stopped after."""
    yield from _spawner()


@pytest.fixture(scope="module")
def module_spawn() -> Iterator[Callable[..., ServerProcess]]:
    """Like spawn, for processes shared by a whole test module."""
    yield from _spawner()
