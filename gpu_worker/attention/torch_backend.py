"""Paged attention in plain torch: the CPU path, and the reference the kernels are held to.

Per step, sequences are split into two groups, decodes (one new token) and prefills (a chunk
of new tokens, possibly after cached context). For each group the step precomputes, once for
all layers, the flat cache index of every context position, the padded query-token index and
the causal mask; each layer then gathers K/V through those indices and runs one batched
scaled_dot_product_attention. Padding exists only inside a group and only up to the group's
longest sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.attention.base import AttentionBackend, BatchLayout


@dataclass
class _Group:
    token_index: torch.Tensor  # [G, Qmax] flat token row of each (seq, query i); pads -> 0
    token_valid: torch.Tensor | None  # [G, Qmax] bool, None when nothing is padded
    kv_index: torch.Tensor  # [G, Lmax] flat cache slot of each context position
    mask: torch.Tensor  # [G, 1, Qmax, Lmax] bool, True = attend


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._groups: list[_Group] = []
        self._slots = torch.empty(0, dtype=torch.long)

    def begin_step(self, layout: BatchLayout) -> None:
        self._slots = layout.slot_mapping
        q_lens = layout.query_lens_host
        decode = [s for s, n in enumerate(q_lens) if n == 1]
        prefill = [s for s, n in enumerate(q_lens) if n > 1]
        self._groups = [self._build_group(layout, g) for g in (decode, prefill) if g]

    def _build_group(self, layout: BatchLayout, seqs: list[int]) -> _Group:
        device = layout.slot_mapping.device
        bs = self.cache.geometry.block_size
        idx = torch.tensor(seqs, dtype=torch.long, device=device)
        q_lens = torch.tensor([layout.query_lens_host[s] for s in seqs], device=device)
        seq_lens = torch.tensor([layout.seq_lens_host[s] for s in seqs], device=device)
        q_max = int(q_lens.max())
        l_max = int(seq_lens.max())
        n_blk = (l_max + bs - 1) // bs

        tables = layout.block_tables[idx, :n_blk].long()
        offsets = torch.arange(bs, device=device)
        kv_index = (tables[:, :, None] * bs + offsets).reshape(len(seqs), n_blk * bs)[:, :l_max]

        i = torch.arange(q_max, device=device)
        starts = layout.query_start_loc[idx].long()
        token_valid = i[None, :] < q_lens[:, None]
        token_index = torch.where(token_valid, starts[:, None] + i[None, :], 0)

        # Query i of a sequence sits at position seq_len - q_len + i and sees keys 0..that.
        q_pos = (seq_lens - q_lens)[:, None] + i[None, :]
        j = torch.arange(l_max, device=device)
        mask = (j[None, None, :] <= q_pos[:, :, None])[:, None]
        return _Group(
            token_index=token_index,
            token_valid=None if bool(token_valid.all()) else token_valid,
            kv_index=kv_index,
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

        out = torch.empty_like(q)
        for g in self._groups:
            qg = q[g.token_index].transpose(1, 2)  # [G, Hq, Qmax, D]
            kg = k_flat[g.kv_index].transpose(1, 2).to(q.dtype)  # [G, Hkv, Lmax, D]
            vg = v_flat[g.kv_index].transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=g.mask, scale=self.scale, enable_gqa=True
            ).transpose(1, 2)  # [G, Qmax, Hq, D]
            if g.token_valid is None:
                out[g.token_index.reshape(-1)] = o.reshape(-1, *o.shape[2:])
            else:
                out[g.token_index[g.token_valid]] = o[g.token_valid]
        return out
