"""The CPU team (`gpu_worker/cpu_team.py`, `csrc/team_cpu.c`): its float32 products against
torch's, items taken back from a helper that lost its core, and a float32 worker that runs its
projections on it, greedy output against transformers.

The team is process-wide (once started, every float32 model loaded after packs for it), so
the checks that start one run in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve import envs
from tests.conftest import MICRO
from tests.oracle import hf_greedy
from tests.procs import ServerProcess
from tests.stack import greedy_to_length, start_stack

CPUS = sorted(os.sched_getaffinity(0))

# Threads bound to cores, busy processes beside them: alone, after the busy phase.
pytestmark = pytest.mark.serial


def _child(script: str) -> dict:
    """Runs a check in a process of its own. Every block over 64 KiB is its own mapping there,
    unmapped when freed (a fixed mmap threshold), so a helper reading an input after Python
    let go of it kills the process (rc -11) rather than reading stale memory."""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _events(log: str) -> list[dict]:
    out = []
    for line in log.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


PRODUCTS = """
import json, os, torch
from gpu_worker import cpu_team
os.sched_setaffinity(0, {CALLER})
team = cpu_team.start(HELPERS, stall_us=STALL)
assert team is not None and team.width == len(HELPERS) + 1
gen = torch.Generator().manual_seed(0)
worst, shapes = 0.0, 0
for m in (1, 5, 6, 7, 47, 48, 49, 64, 130):
    for k in (1, 17, 256):
        for n in (1, 15, 16, 31, 33, 100):
            for with_bias in (False, True):
                w = torch.randn(n, k, generator=gen)
                x = torch.randn(m, k, generator=gen)
                b = torch.randn(n, generator=gen) if with_bias else None
                got = team.linear(x, team.pack(w), n, b)
                want = x.double() @ w.double().T + (0 if b is None else b.double())
                scale = x.abs().double() @ w.abs().double().T + 1
                worst = max(worst, float(((got.double() - want).abs() / scale).max()))
                shapes += 1
# no rows; more panels than one job holds items (the caller alone)
assert team.linear(torch.empty(0, 8), team.pack(torch.randn(5, 8)), 5, None).shape == (0, 5)
w = torch.randn(600_000, 2, generator=gen)
x = torch.randn(3, 2, generator=gen)
wide = (team.linear(x, team.pack(w), 600_000, None).double() - x.double() @ w.double().T)
worst = max(worst, float(wide.abs().max()))
for _ in range(REPEATS):  # the same product again and again: the same answer every time
    x = torch.randn(64, 256, generator=gen)
    w = torch.randn(300, 256, generator=gen)
    p = team.pack(w)
    first = team.linear(x, p, 300, None)
    for _ in range(20):
        assert torch.equal(team.linear(x, p, 300, None), first)
print(json.dumps({"worst": worst, "shapes": shapes, "taken_back": team.taken_back()}))
"""


def _products(caller: int, helpers: list[int], repeats: int, stall_us: int = 0) -> dict:
    script = PRODUCTS.replace("CALLER", str(caller)).replace("HELPERS", repr(helpers))
    return _child(script.replace("REPEATS", str(repeats)).replace("STALL", str(stall_us)))


@pytest.mark.skipif(len(CPUS) < 2, reason="one core: no helper on a core of its own")
def test_products_on_the_team_equal_torchs() -> None:
    got = _products(CPUS[0], [CPUS[1]], 5)
    assert got["shapes"] == 9 * 3 * 6 * 2
    assert got["worst"] < 1e-6  # float32 sums: a few ulps of the terms' magnitude


def test_items_of_a_helper_without_a_core_are_taken_back() -> None:
    """A helper that stalls on every item it claims (as if the gateway took its core): the
    caller takes its items back, every product is still right, and the late results are dropped."""
    got = _products(CPUS[0], [CPUS[-1]], 5, stall_us=2000)
    assert got["worst"] < 1e-6
    assert got["taken_back"] > 0


TILES = """
import json, os, torch
from gpu_worker import cpu_team
os.sched_setaffinity(0, {CALLER})
team = cpu_team.start(HELPERS, stall_us=STALL)
assert team is not None and team.width == len(HELPERS) + 1
gen = torch.Generator().manual_seed(2)
worst, differ, shapes = 0.0, 0, 0
passes = 0
while passes < 1 or (STALL and not team.taken_back() and passes < 20):
    for m in (1, 7, 16, 17, 32, 33, 64, 130):
        # 48: not whole tiles of k, the vdpbf16ps block's; 320: ten steps of k, the last
        # four fetching the next panel's
        for k in (32, 96, 48, 320):
            for n in (1, 31, 33, 100, 300):
                for with_bias in (False, True):
                    w = torch.randn(n, k, generator=gen).bfloat16()
                    x = torch.randn(m, k, generator=gen).bfloat16()
                    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
                    p = team.pack(w, torch.bfloat16)
                    assert cpu_team.set_tiles("MODE") == "MODE"
                    got = team.linear(x, p, n, b).double()
                    assert cpu_team.set_tiles("off") == "off"
                    want = x.double() @ w.double().T + (0 if b is None else b.double())
                    scale = x.abs().double() @ w.abs().double().T + 1
                    worst = max(worst, float(((got - want).abs() / scale).max()))
                    # against the vdpbf16ps block: one rounding to bf16 of float32 sums
                    other = team.linear(x, p, n, b).double()
                    bound = other.abs() / 128 + scale * 2**-20
                    differ += int(((got - other).abs() > bound).sum())
                    shapes += 1
    passes += 1
print(json.dumps({"worst": worst, "differ": differ, "shapes": shapes, "passes": passes,
                  "faults": cpu_team.tile_faults(), "taken_back": team.taken_back()}))
"""


@pytest.mark.parametrize("mode", ["model", "amx"])
@pytest.mark.parametrize("stall_us", [0, 2000])
def test_bf16_products_on_tiles(mode: str, stall_us: int) -> None:
    """The team's bf16 products on AMX tiles (blocks of 1-32 rows, a panel's last columns,
    bias or none), on the CPU's tiles where it has them and on the software model of the tile
    unit everywhere: no operation the CPU would fault on, every output within bf16's rounding
    of the exact product and of the vdpbf16ps block's, with a stalling helper too."""
    from gpu_worker import cpu_isa, cpu_team

    if len(CPUS) < 2 and not stall_us:
        pytest.skip("one core: no helper on a core of its own")
    if mode == "amx" and cpu_isa.bf16_isa() != "amx_bf16":
        pytest.skip("the CPU has no AMX")
    if mode == "amx" and cpu_team.set_tiles("amx") != "amx":
        pytest.skip("Linux refuses the tiles' state to this process, or the build has no AMX")
    if cpu_team.set_tiles("model") != "model":
        pytest.skip("the tiles take AVX512-BF16's panels of 32 columns")
    cpu_team.set_tiles("off")
    script = TILES.replace("CALLER", str(CPUS[0])).replace("HELPERS", repr([CPUS[-1]]))
    got = _child(script.replace("STALL", str(stall_us)).replace("MODE", mode))
    assert got["shapes"] == 8 * 4 * 5 * 2 * got["passes"]
    assert got["faults"] == 0
    assert got["worst"] < 2**-7  # one bf16 rounding of the output
    assert got["differ"] == 0
    if stall_us:
        assert got["taken_back"] > 0


LIFETIME = """
import json, os, torch
from gpu_worker import cpu_team
os.sched_setaffinity(0, {CALLER})
team = cpu_team.start(HELPERS, stall_us=3000)
assert team is not None and team.width == len(HELPERS) + 1
gen = torch.Generator().manual_seed(1)
worst = 0.0
for _ in range(20):
    w = torch.randn(1024, 256, generator=gen)
    x = torch.randn(64, 256, generator=gen)
    b = torch.randn(1024, generator=gen)
    want = x.double() @ w.double().T + b.double()
    got = team.linear(x, team.pack(w), 1024, b)  # the panels' last reference goes here
    del x, b
    worst = max(worst, float((got.double() - want).abs().max()))
print(json.dumps({"worst": worst, "taken_back": team.taken_back()}))
"""


@pytest.mark.parametrize(
    ("isa", "switch", "wanted", "asked"),
    [
        ("amx_bf16", None, "amx", None),  # AMX: the team's tiles by default
        ("amx_bf16", "1", "amx", "amx"),
        ("amx_bf16", "0", None, None),  # oneDNN's tiles on an OpenMP team
        ("amx_bf16", "model", "model", "model"),
        ("avx512_bf16", None, None, None),  # the team's vdpbf16ps block
        ("avx512_bf16", "1", None, None),
        ("avx512_bf16", "model", "model", "model"),
        ("none", None, None, None),
    ],
)
def test_where_a_bf16_workers_team_takes_its_products(
    isa: str, switch: str | None, wanted: str | None, asked: str | None, monkeypatch
) -> None:
    from gpu_worker import cpu_isa, cpu_team

    monkeypatch.setattr(cpu_isa, "bf16_isa", lambda: isa)
    if switch is None:
        monkeypatch.delenv(cpu_team.TILES_SWITCH, raising=False)
    else:
        monkeypatch.setenv(cpu_team.TILES_SWITCH, switch)
    envs.reload()
    assert cpu_team.tiles_wanted() == wanted
    assert cpu_team.tiles_asked() == asked


def test_inputs_outlive_a_helper_that_lost_its_item() -> None:
    """The caller takes a stalled helper's item back and returns; the helper then computes it
    from the product's inputs (a late result, dropped): the panels, rows and bias, whose last
    references the script drops at once, must outlive it (`_child` unmaps freed blocks)."""
    script = LIFETIME.replace("CALLER", str(CPUS[0])).replace("HELPERS", repr([CPUS[-1]]))
    got = _child(script)
    assert got["taken_back"] > 0
    assert got["worst"] < 1e-3


WIDE = """
import json, os, torch, torch.nn.functional as F
from gpu_worker import cpu_team
os.sched_setaffinity(0, CALLER)
with cpu_team.torch_threads(1 << 40):
    before = torch.get_num_threads()  # no team yet: left alone
team = cpu_team.start(HELPERS)
assert team is not None and team.width == len(HELPERS) + 1
torch.set_num_threads(1)  # as the worker does once its team runs
q = torch.randn(1, 4, 300, 32)
want = F.scaled_dot_product_attention(q, q, q, is_causal=True)
with cpu_team.torch_threads(cpu_team.WIDE_WORK - 1):
    small = torch.get_num_threads()
with cpu_team.torch_threads(cpu_team.WIDE_WORK):
    large = torch.get_num_threads()
    got = F.scaled_dot_product_attention(q, q, q, is_causal=True)
print(json.dumps({"before": before, "small": small, "large": large,
                  "after": torch.get_num_threads(), "worst": float((got - want).abs().max())}))
"""


@pytest.mark.skipif(len(CPUS) < 2, reason="one core: no helper on a core of its own")
def test_long_torch_ops_run_on_as_many_threads_as_the_team() -> None:
    """A long torch op with no path on the team (prompt attention through SDPA) runs on as
    many OpenMP threads as the team has; short ones and everything after stay on one."""
    script = WIDE.replace("CALLER", repr(set(CPUS[:2]))).replace("HELPERS", repr([CPUS[1]]))
    got = _child(script)
    assert (got["small"], got["large"], got["after"]) == (1, 2, 1)
    assert got["before"] == 1  # the child's OMP_NUM_THREADS
    assert got["worst"] < 1e-5


@pytest.mark.skipif(len(CPUS) < 2, reason="one core: the worker starts no team")
def test_a_float32_worker_on_the_team_matches_transformers(
    spawn: Callable[..., ServerProcess], make_checkpoint: Callable[..., Path]
) -> None:
    """qwen2: biased qkv projections; prompts long enough for several row blocks per step."""
    model_dir = make_checkpoint("qwen2", seed=3, **{**MICRO, "num_key_value_heads": 4})
    prompts = [[(7 * i + 11 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((1, 60, 130))]
    max_tokens = [40, 25, 30]
    expected = hf_greedy(model_dir, prompts, max_tokens)
    # Without the tests' one-thread default the worker binds its threads: the team's case.
    stack = start_stack(spawn, model_dir, dtype="float32", worker_env={"OMP_NUM_THREADS": None})
    team = [e for e in _events(stack.workers[0].output()) if e.get("event") == "cpu_team"]
    assert team and team[0]["helpers"] == 1, stack.workers[0].output()[-2000:]
    got = [greedy_to_length(stack.stub, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    assert got == expected


def _same_as_openmp(script: str, stall_us: int) -> None:
    """Runs a script that compares a kernel on the team with its OpenMP path in a child: with a
    helper on a core of its own (stall_us 0), or one that stalls on every item (its items
    taken back: some must have been)."""
    helper = CPUS[-1] if len(CPUS) > 1 or stall_us else None
    if helper is None:
        pytest.skip("one core: no helper on a core of its own")
    script = script.replace("CALLER", str(CPUS[0])).replace("HELPERS", repr([helper]))
    got = _child(script.replace("STALL", str(stall_us)))
    assert got["same"]
    if stall_us:
        assert got["taken_back"] > 0


DECODE = """
import json, os, torch
from gpu_worker import cpu_team
from tests.test_cpu_fast_paths import SHAPES, _decode_case, _run_decode
os.sched_setaffinity(0, {CALLER})
dtypes = (torch.float32, torch.bfloat16)
cases = [(_decode_case(*shape, dt), dt) for shape in SHAPES for dt in dtypes]
alone = [_run_decode(c, dtype) for c, dtype in cases]  # OpenMP, one thread
team = cpu_team.start(HELPERS, stall_us=STALL)
assert team is not None and team.width == len(HELPERS) + 1
same, passes = True, 0
# two passes at least; with a stalling helper, until an item was taken back (a helper woken
# late on a busy machine may find every item of a pass claimed already)
while passes < 2 or (STALL and not team.taken_back() and passes < 100):
    same &= all(torch.equal(_run_decode(c, dtype), want) for (c, dtype), want in zip(cases, alone))
    passes += 1
print(json.dumps({"same": same, "taken_back": team.taken_back()}))
"""


@pytest.mark.parametrize("stall_us", [0, 2000])
def test_decode_attention_on_the_team_equals_its_openmp_path(stall_us: int) -> None:
    """Each sequence's heads are the same arithmetic wherever they run: bit for bit, with a
    helper on a core of its own and with one that stalls on every item."""
    _same_as_openmp(DECODE, stall_us)


PREFILL = """
import json, os, torch
from gpu_worker import cpu_team
from gpu_worker.attention import cpu_prefill
from tests.test_cpu_prefill_kernel import LENS, SHAPES
os.sched_setaffinity(0, {CALLER})

def case(h, kv, d, dtype, lens):
    torch.manual_seed(h * 100 + d)
    starts, at = [], 3
    for n in lens:
        starts.append(at)
        at += n + 2
    qkv = torch.randn(at, h + 2 * kv, d).to(dtype)
    return (qkv[:, :h], qkv[:, h : h + kv], qkv[:, h + kv :],
            torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32))

def after_context(dtype, ctx):  # two segments of 8 and 5 rows after ctx cached bf16 keys
    q, k, v, starts, lens = case(12, 4, 64, dtype, [8, 5])
    blocks = -(-ctx // 16)
    k_cache, v_cache = (torch.randn(2 * blocks, 16, 4, 64).to(torch.bfloat16) for _ in "kv")
    tables = torch.randperm(2 * blocks).view(2, blocks).to(torch.int32).contiguous()
    ctxs = torch.tensor([ctx, ctx - 3], dtype=torch.int32)
    return q, k, v, starts, lens, cpu_prefill.PagedContext(ctxs, k_cache, v_cache, tables)

def run(c):
    q, k, v, starts, lens, *context = c
    out = torch.full(q.shape, 7.0, dtype=q.dtype)
    cpu_prefill.prefill_attention(out, q, k, v, starts, lens, q.shape[2] ** -0.5, *context)
    return out

dtypes = (torch.float32, torch.bfloat16)
# every shape, then fewer and longer segments (the buffer of phase 1 grows), then chunks after
# a context long enough to take the buffer past 16 MiB and short ones (it is given back)
cases = [case(*shape, dt, LENS) for shape in SHAPES for dt in dtypes]
cases += [case(12, 4, 64, dt, [300, 7]) for dt in dtypes]
cases += [after_context(dt, ctx) for ctx in (6000, 40) for dt in dtypes]
alone = [run(c) for c in cases]  # OpenMP, one thread
team = cpu_team.start(HELPERS, stall_us=STALL)
assert team is not None and team.width == len(HELPERS) + 1
same, passes = True, 0
while passes < 2 or (STALL and not team.taken_back() and passes < 100):  # as DECODE's
    same &= all(torch.equal(run(c), want) for c, want in zip(cases, alone))
    passes += 1
print(json.dumps({"same": same, "taken_back": team.taken_back()}))
"""


@pytest.mark.parametrize("stall_us", [0, 500])
def test_prompt_attention_on_the_team_equals_its_openmp_path(stall_us: int) -> None:
    """Phase 2's tiles on the team, bit for bit as on OpenMP; with a stalling helper, its
    tiles taken back while later calls leave the buffer it may still read alone."""
    _same_as_openmp(PREFILL, stall_us)
