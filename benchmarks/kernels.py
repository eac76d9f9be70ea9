"""Kernel benchmark: paged decode and prefill attention at a Llama-3-8B head layout (32 query
heads, 8 kv heads, head_dim 128), beside torch SDPA on a contiguous cache.

    python -m benchmarks.kernels [--quick] [--out PATH] [--peak-gbps GBPS]

On CUDA it times decode over batch 1-256 x context 512-32k (both the one-pass and the split-K
kernel; `chosen` is what the worker's heuristic runs) and single-sequence prefills of 1k-8k
tokens, in bf16. Bandwidth is the KV bytes a step must read (each context's K and V once)
divided by the time, and `peak_frac` divides that by the device's peak (a table by device name,
or --peak-gbps). On the CPU, or with --quick, it runs a tiny configuration under the Triton
interpreter, which only shows that the harness works: interpreter times mean nothing.
A table goes to stdout, every figure to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Off a GPU the kernels only run under the interpreter, which must be on before triton imports.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from kernels.paged_decode import paged_decode_attention  # noqa: E402
from kernels.paged_decode_splitk import paged_decode_attention_splitk, use_split_k  # noqa: E402
from kernels.paged_prefill import (  # noqa: E402
    paged_prefill_attention,
    plan_prefill_tiles,
    prefill_config,
)

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DEFAULT_OUT = Path("benchmarks/results/kernels.json")

# Peak HBM bandwidth, GB/s, by a substring of torch.cuda.get_device_name() (first match wins).
PEAK_GBPS = [
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("RTX 4090", 1008.0),
    ("A10G", 600.0),
    ("L4", 300.0),
]


@dataclass(frozen=True)
class Sizes:
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    max_kv_tokens: int  # batch x context cap


FULL = Sizes(
    decode_batches=(1, 8, 32, 64, 128, 256),
    decode_contexts=(512, 2048, 8192, 32768),
    prefill_tokens=(1024, 2048, 4096, 8192),
    max_kv_tokens=1 << 21,  # 8 GiB of bf16 KV, held twice (paged cache + SDPA's copy)
)
QUICK = Sizes(
    decode_batches=(1, 2), decode_contexts=(48,), prefill_tokens=(40,), max_kv_tokens=1 << 10
)


def peak_gbps(device: torch.device, override: float | None) -> float | None:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    # The interpreter: nothing to warm up or to average; one call shows the harness runs.
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def paged_cache(
    seq_lens: Sequence[int], block_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V caches holding every sequence, in randomly permuted blocks, and the block tables."""
    blocks = [triton.cdiv(n, block_size) for n in seq_lens]
    perm = torch.randperm(sum(blocks), device=device, dtype=torch.int32)
    tables = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32, device=device)
    at = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = perm[at : at + nb]
        at += nb
    shape = (sum(blocks), block_size, NUM_KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, dtype=dtype, device=device)
    v = torch.randn(shape, dtype=dtype, device=device)
    return k, v, tables


def kv_bytes(tokens: int, dtype: torch.dtype) -> int:
    return 2 * tokens * NUM_KV_HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()


def rates(row: dict[str, Any], key: str, ms: float, nbytes: int, peak: float | None) -> None:
    gbps = nbytes / (ms * 1e-3) / 1e9
    row[f"{key}_ms"] = ms
    row[f"{key}_gbps"] = gbps
    row[f"{key}_peak_frac"] = gbps / peak if peak else None


def bench_decode(
    batch: int, context: int, cfg: argparse.Namespace, device: torch.device, peak: float | None
) -> dict[str, Any]:
    dtype, scale = cfg.torch_dtype, HEAD_DIM**-0.5
    k, v, tables = paged_cache([context] * batch, cfg.block_size, dtype, device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn((batch, NUM_Q_HEADS, HEAD_DIM), dtype=dtype, device=device)
    args = (q, k, v, tables, seq_lens, scale)
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 0
    )
    chosen = use_split_k(batch, NUM_KV_HEADS, context, num_sms, cfg.partition_size)
    row: dict[str, Any] = {"batch": batch, "context": context, "split_k_chosen": chosen}
    nbytes = kv_bytes(batch * context, dtype)
    row["kv_bytes"] = nbytes
    one_pass = time_ms(lambda: paged_decode_attention(*args), device)
    split = time_ms(
        lambda: paged_decode_attention_splitk(
            *args, max_seq_len=context, partition_size=cfg.partition_size
        ),
        device,
    )
    rates(row, "one_pass", one_pass, nbytes, peak)
    rates(row, "split_k", split, nbytes, peak)
    rates(row, "triton", split if chosen else one_pass, nbytes, peak)
    del k, v
    kc = torch.randn((batch, NUM_KV_HEADS, context, HEAD_DIM), dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    qc = q.unsqueeze(2)  # [batch, heads, 1, head_dim]
    sdpa = time_ms(lambda: F.scaled_dot_product_attention(qc, kc, vc, enable_gqa=True), device)
    rates(row, "sdpa", sdpa, nbytes, peak)
    return row


def bench_prefill(
    tokens: int, cfg: argparse.Namespace, device: torch.device, peak: float | None
) -> dict[str, Any]:
    dtype, scale = cfg.torch_dtype, HEAD_DIM**-0.5
    k, v, tables = paged_cache([tokens], cfg.block_size, dtype, device)
    q = torch.randn((tokens, NUM_Q_HEADS, HEAD_DIM), dtype=dtype, device=device)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    nbytes = kv_bytes(tokens, dtype)
    flops = 4 * NUM_Q_HEADS * HEAD_DIM * tokens * (tokens + 1) / 2  # causal QK^T and PV
    row: dict[str, Any] = {"tokens": tokens, "kv_bytes": nbytes, "flops": flops}
    # Tiles planned once, as the worker plans them once per step for every layer.
    block_m = prefill_config(device, dtype, HEAD_DIM, cfg.block_size).block_m
    tiles = plan_prefill_tiles([tokens], NUM_Q_HEADS // NUM_KV_HEADS, device, block_m=block_m)
    ms = time_ms(
        lambda: paged_prefill_attention(q, k, v, tables, qsl, seq_lens, scale, tiles=tiles),
        device,
    )
    rates(row, "triton", ms, nbytes, peak)
    row["triton_tflops"] = flops / (ms * 1e-3) / 1e12
    qc = q.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, head_dim]
    kc = torch.randn((1, NUM_KV_HEADS, tokens, HEAD_DIM), dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    ms = time_ms(
        lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True),
        device,
    )
    rates(row, "sdpa", ms, nbytes, peak)
    row["sdpa_tflops"] = flops / (ms * 1e-3) / 1e12
    return row


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def print_table(title: str, rows: list[dict[str, Any]], cols: list[str]) -> None:
    print(f"\n{title}")
    cells = [cols] + [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    for line in cells:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="tiny smoke configuration")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    p.add_argument("--peak-gbps", type=float, default=None, help="device peak bandwidth, GB/s")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--partition-size", type=int, default=512, help="split-K partition")
    a = p.parse_args(argv)
    a.torch_dtype = getattr(torch, a.dtype)
    return a


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = cfg.quick or device.type != "cuda"
    sizes = QUICK if quick else FULL
    if quick and cfg.partition_size > 32:
        cfg.partition_size = 32  # several partitions even at the smoke contexts
    peak = peak_gbps(device, cfg.peak_gbps)
    torch.manual_seed(0)

    decode = [
        bench_decode(b, c, cfg, device, peak)
        for c in sizes.decode_contexts
        for b in sizes.decode_batches
        if b * c <= sizes.max_kv_tokens
    ]
    prefill = [bench_prefill(n, cfg, device, peak) for n in sizes.prefill_tokens]

    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "interpreter": device.type != "cuda",
        "mode": "quick" if quick else "full",
        "peak_gbps": peak,
        "dtype": cfg.dtype,
        "block_size": cfg.block_size,
        "partition_size": cfg.partition_size,
        "layout": {"num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "decode": decode,
        "prefill": prefill,
    }
    if report["interpreter"]:
        print("no CUDA device: Triton interpreter smoke run; the times are not performance")
    print_table(
        f"decode ({cfg.dtype}, block {cfg.block_size}; GB/s of KV read; peak {_fmt(peak)})",
        decode,
        ["batch", "context", "split_k_chosen", "one_pass_ms", "split_k_ms", "triton_gbps",
         "triton_peak_frac", "sdpa_ms", "sdpa_gbps", "sdpa_peak_frac"],
    )  # fmt: skip
    print_table(
        "prefill (one sequence)",
        prefill,
        ["tokens", "triton_ms", "triton_tflops", "triton_gbps", "sdpa_ms", "sdpa_tflops"],
    )
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
