"""Paged attention in plain torch: the CPU path, and the reference the kernels are held to.

Per step, sequences are split into two groups, decodes (one new token) and prefills (a chunk
of new tokens, possibly after cached context). For each group the step precomputes, once for
all layers, the block ids of every sequence's context, the padded query-token index and the
causal mask; each layer then gathers whole K/V blocks through those ids and runs one batched
scaled_dot_product_attention. Padding exists only inside a group and only up to the group's
longest sequence (rounded up to whole blocks; the mask hides the tail).

On a CPU with AVX-512 in float32 or bfloat16 one call of `cpu_prefill` (a C kernel) computes
every prefill of the step: fresh prompts from the step's own K/V, chunks after cached context
reading that context through their block tables. Elsewhere (and on CPUs without AVX-512, where
SDPA is faster: `cpu_prefill.preferred`) a prefill with no cached context (the whole prompt in
this step) runs causal SDPA straight on its slice of q, k, v (`causal_attention`): no gather,
no padding; chunks after context take the gathered, masked path above.

On a CPU with a float32 or bfloat16 cache the decode group skips the gather: `cpu_decode` (a
small C kernel) reads K/V in place through the block tables, one pass over each context. Other
dtypes (the float64 exactness tests), other devices and machines without a C compiler keep
the SDPA path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker import cpu_team
from gpu_worker.attention import cpu_decode, cpu_prefill
from gpu_worker.attention.base import AttentionBackend, BatchLayout


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of one sequence's tokens among themselves: `[T, heads, D]` in and out,
    fewer kv heads than query heads allowed.

    The inputs get a batch dimension: given 3-d tensors, CPU SDPA falls back to its
    unfused math path (a full score matrix per head), several times slower.
    """
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, Hq, T, D]
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


@dataclass
class _Group:
    token_index: torch.Tensor  # [G, Qmax] flat token row of each (seq, query i); pads -> 0
    token_valid: torch.Tensor | None  # [G, Qmax] bool, None when nothing is padded
    block_ids: torch.Tensor  # [G * Bmax] physical block of each (seq, logical block), flat
    mask: torch.Tensor  # [G, 1, Qmax, Bmax * block_size] bool, True = attend


@dataclass
class _KernelDecodes:
    rows: torch.Tensor  # [S] int64 flat token row of each decode sequence
    block_tables: torch.Tensor  # [S, W] int32, contiguous
    seq_lens: torch.Tensor  # [S] int32
    max_len: int


# One call of the prefill kernel: (starts, lens, ctx, block_tables), the last two None where
# no segment has context.
_PrefillCall = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


@dataclass
class _KernelPrefills:
    """The step's prefills for `cpu_prefill`, in calls of at most MAX_WIDENED_FLOATS."""

    calls: list[_PrefillCall]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # The prefill kernel widens each call's keys and values to float32 (KV x 2 x D floats per
    # key, context included); a step whose prefills need more splits into several calls.
    MAX_WIDENED_FLOATS = 1 << 24

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._groups: list[_Group] = []
        self._decodes: _KernelDecodes | None = None
        self._fresh: list[tuple[int, int]] = []  # (first token row, end) of fresh prefills
        # Every prefill of the step for the prefill kernel; None when it is not used.
        self._segments: _KernelPrefills | None = None
        self._chunks: list[int] = []  # prefills after cached context, for the fallback
        self._layout: BatchLayout | None = None
        self._slots = torch.empty(0, dtype=torch.long)
        kv = self.cache.kv
        self.use_decode_kernel = (
            kv.device.type == "cpu"
            and cpu_decode.supports(self.head_dim, kv.dtype)
            and cpu_decode.load() is not None
        )
        self.use_prefill_kernel = (
            kv.device.type == "cpu" and cpu_prefill.preferred() and cpu_prefill.load() is not None
        )

    def begin_step(self, layout: BatchLayout) -> None:
        self._slots = layout.slot_mapping
        q_lens = layout.query_lens_host
        decode = [s for s, n in enumerate(q_lens) if n == 1]
        prefill = [s for s, n in enumerate(q_lens) if n > 1]
        fresh = [s for s in prefill if layout.seq_lens_host[s] == q_lens[s]]
        chunks = [s for s in prefill if layout.seq_lens_host[s] != q_lens[s]]
        starts = layout.query_start_loc.tolist() if prefill else []
        self._fresh = [(starts[s], starts[s] + q_lens[s]) for s in fresh]
        self._segments = None
        self._layout, self._chunks = layout, chunks
        if prefill and self.use_prefill_kernel and self._kernel_reads_cache():
            self._segments = self._kernel_prefills(layout, fresh + chunks, starts)
            chunks = []
        self._decodes = None
        if decode and self.use_decode_kernel:
            self._decodes = self._kernel_decodes(layout, decode)
            decode = []
        self._groups = [self._build_group(layout, g) for g in (decode, chunks) if g]

    def _kernel_reads_cache(self) -> bool:
        kv = self.cache.kv
        return kv.device.type == "cpu" and cpu_prefill.supports(self.head_dim, kv.dtype)

    def _kernel_prefills(
        self, layout: BatchLayout, seqs: list[int], starts: list[int]
    ) -> _KernelPrefills:
        g = self.cache.geometry
        per_key = 2 * g.num_kv_heads * g.head_dim
        calls: list[list[int]] = [[]]
        widened = 0
        for s in seqs:
            keys = -(-layout.seq_lens_host[s] // 16) * 16
            if calls[-1] and widened + keys * per_key > self.MAX_WIDENED_FLOATS:
                calls.append([])
                widened = 0
            calls[-1].append(s)
            widened += keys * per_key
        planned: list[_PrefillCall] = []
        for part in calls:
            ctx = [layout.seq_lens_host[s] - layout.query_lens_host[s] for s in part]
            seg_starts = torch.tensor([starts[s] for s in part], dtype=torch.int32)
            lens = torch.tensor([layout.query_lens_host[s] for s in part], dtype=torch.int32)
            if not any(ctx):
                planned.append((seg_starts, lens, None, None))
                continue
            idx = torch.tensor(part, dtype=torch.long)
            tables = layout.block_tables.index_select(0, idx).to(torch.int32).contiguous()
            planned.append((seg_starts, lens, torch.tensor(ctx, dtype=torch.int32), tables))
        return _KernelPrefills(planned)

    def _kernel_decodes(self, layout: BatchLayout, seqs: list[int]) -> _KernelDecodes:
        if len(seqs) == layout.num_seqs:
            idx = None  # the common all-decode step: no re-indexing
        else:
            idx = torch.tensor(seqs, dtype=torch.long, device=layout.seq_lens.device)
        starts = layout.query_start_loc[:-1] if idx is None else layout.query_start_loc[idx]
        tables = layout.block_tables if idx is None else layout.block_tables[idx]
        lens = layout.seq_lens if idx is None else layout.seq_lens[idx]
        return _KernelDecodes(
            rows=starts.long(),
            block_tables=tables.to(torch.int32).contiguous(),
            seq_lens=lens.to(torch.int32).contiguous(),
            max_len=max(layout.seq_lens_host[s] for s in seqs),
        )

    def _build_group(self, layout: BatchLayout, seqs: list[int]) -> _Group:
        device = layout.slot_mapping.device
        bs = self.cache.geometry.block_size
        idx = torch.tensor(seqs, dtype=torch.long, device=device)
        q_lens = torch.tensor([layout.query_lens_host[s] for s in seqs], device=device)
        seq_lens = torch.tensor([layout.seq_lens_host[s] for s in seqs], device=device)
        q_max = int(q_lens.max())
        n_blk = (int(seq_lens.max()) + bs - 1) // bs

        block_ids = layout.block_tables[idx, :n_blk].long().reshape(-1)

        i = torch.arange(q_max, device=device)
        starts = layout.query_start_loc[idx].long()
        token_valid = i[None, :] < q_lens[:, None]
        token_index = torch.where(token_valid, starts[:, None] + i[None, :], 0)

        # Query i of a sequence sits at position seq_len - q_len + i and sees keys 0..that;
        # the positions past seq_len in the last block are thereby hidden too.
        q_pos = (seq_lens - q_lens)[:, None] + i[None, :]
        j = torch.arange(n_blk * bs, device=device)
        mask = (j[None, None, :] <= q_pos[:, :, None])[:, None]
        return _Group(
            token_index=token_index,
            token_valid=None if bool(token_valid.all()) else token_valid,
            block_ids=block_ids,
            mask=mask,
        )

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.layer(layer_idx)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, self._slots, k.to(k_flat.dtype))
        v_flat.index_copy_(0, self._slots, v.to(v_flat.dtype))

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        d = self._decodes
        if d is not None:
            # The kernel reads and writes in the cache's dtype (a model and a cache of
            # different dtypes meet there through one conversion each way).
            same = q.dtype == k_cache.dtype
            kernel_out = out if same else torch.empty(q.shape, dtype=k_cache.dtype)
            cpu_decode.paged_decode(
                kernel_out,
                q if same else q.to(k_cache.dtype),
                d.rows,
                k_cache,
                v_cache,
                d.block_tables,
                d.seq_lens,
                d.max_len,
                self.scale,
            )
            if not same:
                out[d.rows] = kernel_out[d.rows].to(q.dtype)
        segments = self._segments
        if segments is not None and not cpu_prefill.supports(head_dim, q.dtype):
            # A model dtype the kernel does not take (the float64 oracle over a narrower cache).
            assert self._layout is not None
            self._segments = segments = None
            if self._chunks:
                self._groups.append(self._build_group(self._layout, self._chunks))
        if segments is not None:
            for starts, lens, ctx, tables in segments.calls:
                context = None
                if ctx is not None and tables is not None:
                    context = cpu_prefill.PagedContext(ctx, k_cache, v_cache, tables)
                cpu_prefill.prefill_attention(out, q, k, v, starts, lens, self.scale, context)
        else:
            for start, end in self._fresh:
                with cpu_team.torch_threads(q.shape[1] * head_dim * (end - start) ** 2):
                    out[start:end] = causal_attention(
                        q[start:end], k[start:end], v[start:end], self.scale
                    )
        for g in self._groups:
            num_seqs = g.token_index.shape[0]
            qg = q[g.token_index].transpose(1, 2)  # [G, Hq, Qmax, D]
            kg = k_cache.index_select(0, g.block_ids).view(num_seqs, -1, num_kv_heads, head_dim)
            vg = v_cache.index_select(0, g.block_ids).view(num_seqs, -1, num_kv_heads, head_dim)
            with cpu_team.torch_threads(2 * qg.numel() * kg.shape[1]):
                o = F.scaled_dot_product_attention(
                    qg,
                    kg.transpose(1, 2).to(q.dtype),  # [G, Hkv, Bmax * block_size, D]
                    vg.transpose(1, 2).to(q.dtype),
                    attn_mask=g.mask,
                    scale=self.scale,
                    enable_gqa=True,
                ).transpose(1, 2)  # [G, Qmax, Hq, D]
            if g.token_valid is None:
                out[g.token_index.reshape(-1)] = o.reshape(-1, *o.shape[2:])
            else:
                out[g.token_index[g.token_valid]] = o[g.token_valid]
        return out
