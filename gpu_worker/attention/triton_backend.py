"""Paged attention with the Triton kernels: the CUDA path (and, under TRITON_INTERPRET=1, a slow
CPU path for tests).

Per layer: reshape_and_cache writes the step's K/V into their slots; then sequences with one new
token go to the decode kernel (split-K when few sequences have long contexts) and the others
to the prefill kernel, which reads cached context and new tokens alike through the block table.
Which rows go where, the decode subset's tables and the prefill tile list are worked out once
per step in begin_step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.attention.base import AttentionBackend, BatchLayout
from gpu_worker.kv_cache import KVCache
from kernels import envelope
from kernels.paged_decode import paged_decode_attention
from kernels.paged_decode_splitk import paged_decode_attention_splitk, use_split_k
from kernels.paged_prefill import (
    PrefillTiles,
    paged_prefill_attention,
    plan_prefill_tiles,
    prefill_config,
)
from kernels.reshape_and_cache import reshape_and_cache


@dataclass
class _Decode:
    rows: torch.Tensor | None  # [B] token rows of the decode sequences; None: every row, in order
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    max_seq_len: int
    split_k: bool


@dataclass
class _Step:
    layout: BatchLayout
    decode: _Decode | None
    prefill: PrefillTiles | None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, cache: KVCache, num_heads: int, head_dim: int) -> None:
        super().__init__(cache, num_heads, head_dim)
        g = cache.geometry
        envelope.check_config(num_heads, g.num_kv_heads, head_dim, g.block_size, g.dtype)
        device = cache.kv.device
        if device.type == "cpu" and not envelope.interpreter_enabled():
            raise ValueError(
                "attention backend 'triton' needs a CUDA device; on the CPU it runs only under"
                " the Triton interpreter (TRITON_INTERPRET=1, slow, for tests)."
                " Use --attention-backend torch"
            )
        self.num_kv_heads = g.num_kv_heads
        self.queries_per_kv = num_heads // g.num_kv_heads
        self.prefill_block_m = prefill_config(device, g.dtype, head_dim, g.block_size).block_m
        # Sizes the split-K choice; 0 on the CPU, where the interpreter gains nothing from it.
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 0
        )
        self._step: _Step | None = None

    def begin_step(self, layout: BatchLayout) -> None:
        q_lens = layout.query_lens_host
        device = layout.slot_mapping.device
        decodes = [s for s, n in enumerate(q_lens) if n == 1]
        decode = None
        if decodes:
            max_len = max(layout.seq_lens_host[s] for s in decodes)
            split = use_split_k(len(decodes), self.num_kv_heads, max_len, self.num_sms)
            if len(decodes) == len(q_lens):
                decode = _Decode(None, layout.block_tables, layout.seq_lens, max_len, split)
            else:
                starts = [0]
                for n in q_lens:
                    starts.append(starts[-1] + n)
                idx = torch.tensor(decodes, dtype=torch.long, device=device)
                rows = torch.tensor([starts[s] for s in decodes], dtype=torch.long, device=device)
                tables = layout.block_tables[idx]
                decode = _Decode(rows, tables, layout.seq_lens[idx], max_len, split)
        prefill = None
        if len(decodes) < len(q_lens):
            prefill = plan_prefill_tiles(
                q_lens, self.queries_per_kv, device, min_query_len=2, block_m=self.prefill_block_m
            )
        self._step = _Step(layout, decode, prefill)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        step = self._step
        if step is None:
            raise RuntimeError("begin_step must run before forward")
        k_cache, v_cache = self.cache.layer(layer_idx)
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        reshape_and_cache(k, v, k_cache, v_cache, step.layout.slot_mapping)

        out = torch.empty_like(q)
        d = step.decode
        if d is not None:
            q_dec = q if d.rows is None else q[d.rows]
            out_dec = out if d.rows is None else None
            if d.split_k:
                o = paged_decode_attention_splitk(
                    q_dec,
                    k_cache,
                    v_cache,
                    d.block_tables,
                    d.seq_lens,
                    self.scale,
                    max_seq_len=d.max_seq_len,
                    out=out_dec,
                )
            else:
                o = paged_decode_attention(
                    q_dec, k_cache, v_cache, d.block_tables, d.seq_lens, self.scale, out=out_dec
                )
            if d.rows is not None:
                out[d.rows] = o
        if step.prefill is not None:
            lay = step.layout
            paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                lay.block_tables,
                lay.query_start_loc,
                lay.seq_lens,
                self.scale,
                tiles=step.prefill,
                out=out,
            )
        return out
