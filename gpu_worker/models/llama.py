"""One decoder for the Llama family: Llama, Mistral, Qwen2 and Qwen3 checkpoints.

Tokens of every sequence in a step are flattened into one dimension (no batch, no padding);
positions say where each token sits in its sequence and the `AttentionFn` knows the rest.

Per layer, with merged projections (one matmul each):

    x = rms_norm(h)
    q|k|v = x @ W_qkv^T (+ b_qkv)          [T, (H + 2*KV) * D] viewed as [T, H + 2*KV, D]
    q|k = rope(qk_norm(q|k))                 qk_norm only for Qwen3
    h = h + attn(q, k, v) @ W_o^T (+ b_o)
    x = rms_norm(h)
    gate|up = x @ W_gate_up^T
    h = h + (silu(gate) * up) @ W_down^T

Each residual add is carried to the next norm (`add_rms_norm(h, delta)`, the final norm takes
the last layer's), and the elementwise steps run through `fused_ops`: torch's ops, or in
bfloat16 on a CPU one fused C pass each.

Weights are allocated empty here; `load_weights` fills them from HF-named tensors.

On a CPU in float32, and in bfloat16 where oneDNN computes it natively (AVX512-BF16, AMX),
loading also keeps a oneDNN-prepacked copy of every projection and of the LM head
(`prepack`): oneDNN then skips re-laying out the weight on every call, which is most of a
small matmul's time (float32: 40-80% faster at 64-150 rows on AVX-512; bf16: 1.4-1.9x at 16-64
rows with AMX). Results differ from `F.linear` by rounding only. Other dtypes (the float64
exactness tests) and devices use `F.linear`. PAGEDSERVE_ONEDNN_LINEAR=0 turns prepacking off.

A bfloat16 model on a CPU without bf16 products (AVX2 only) is "widened": the prepacked copies
are float32 (every bf16 weight is exactly a float32), and a projection widens its bf16 input,
multiplies in float32 and rounds its output to bf16 once. That is what a native bf16 product
computes (exact products, float32 sums), at float32 speed: torch's bf16 `F.linear` there runs
at 9 GFLOP/s against 64-72 for this path (64-512 rows x 768 x 2048, one Zen 3 core). The LM
head's logits then come out in float32 whole. PAGEDSERVE_BF16_WIDEN=1 takes this path on any
CPU (to compare it with the native one).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import cpu_isa, cpu_team
from gpu_worker.models.base import AttentionFn, TensorParallel
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.fused_ops import TorchOps, ops_for
from gpu_worker.models.rope import cos_sin_table, inv_frequencies
from pagedserve import envs

TensorSource = Callable[[str], torch.Tensor]
"""Returns the checkpoint tensor with the given HF name."""

# The row count oneDNN lays packed weights out for; decode batches sit around it.
PACK_BATCH_HINT = 64
# oneDNN compiles a bf16 (AMX / AVX512-BF16) kernel for every row count it meets and keeps
# 1,024 in its cache: steps whose rows vary (prefill chunks beside decodes) would compile on
# most steps and evict one another. A bf16 product of more than BF16_PIECES[-1] rows therefore
# runs in pieces of those sizes, largest first, then the remainder, and every row count it
# meets is one that `warm_up` compiles at startup. Pieces of 512 rows run within ~10% of one
# 2,048-row product. Where the CPU has AMX, the rows are also padded to a multiple of 16
# (`bf16_row_align`): AMX multiplies 16-row tiles, so a 17-row product costs what a 32-row one
# does, and its kernels take 5-40 ms each to compile. With AVX512-BF16 alone a product costs
# about what its own rows do and a kernel compiles in under a millisecond, so rows are not
# padded there (on a Zen 4, padding added 14% to the projections of decode steps of 1-64 rows).
BF16_PIECES = (512, 128)
AMX_ROW_ALIGN = 16
# Logits of each row recomputed in float32 after a half-precision LM head (compute_logits):
# more than the 20 alternatives logprobs can ask for.
REFINE_TOP = 32


def pack_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The dtype of the prepacked oneDNN copies of a `dtype` model's projections on `device`:
    float32 for float32, bfloat16 for bfloat16 where oneDNN multiplies it natively, float32
    for bfloat16 elsewhere (widened); None where projections run `F.linear`."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if not envs.get().onednn_linear:
        return None
    if dtype == torch.bfloat16:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        widen = envs.get().bf16_widen
        return torch.bfloat16 if native and not widen else torch.float32
    return torch.float32 if dtype == torch.float32 else None


@functools.cache
def bf16_row_align() -> int:
    """The multiple that prepacked bf16 products' row counts are padded to: AMX_ROW_ALIGN
    where the CPU has AMX, else 1 (PAGEDSERVE_BF16_ROW_ALIGN overrides)."""
    if forced := envs.get().bf16_row_align:
        return forced
    return AMX_ROW_ALIGN if cpu_isa.bf16_isa() == "amx_bf16" else 1


def prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return pack_dtype(dtype, device) is not None


def _pack(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """oneDNN's copy of `weight` in `dtype`; where the worker runs the CPU team, `cpu_team`'s
    panels instead (3-D, which `_linear` tells apart)."""
    if weight.device.type == "cpu" and (team := cpu_team.current()):
        return team.pack(weight, dtype)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), PACK_BATCH_HINT)


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear`, through the prepacked oneDNN weight when there is one (widened to float32
    when that copy is float32 and `x` is not)."""
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.dim() == 3:  # the CPU team's panels
        team = cpu_team.current()
        assert team is not None
        if x.dtype != packed.dtype:  # widened
            b = None if bias is None else bias.to(packed.dtype)
            return team.linear(x.to(packed.dtype), packed, weight.shape[0], b).to(x.dtype)
        return team.linear(x, packed, weight.shape[0], bias)
    if packed.dtype != x.dtype:  # widened: one rounding, of the output
        b = None if bias is None else bias.to(packed.dtype)
        out = torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, b, "none", [], "")
        return out.to(x.dtype)
    rows = x.shape[0]
    if x.dtype != torch.bfloat16:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    align = bf16_row_align()
    padded = -(-rows // align) * align
    if padded != rows:
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
    if padded <= BF16_PIECES[-1]:
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out if padded == rows else out[:rows]
    out = torch.empty(padded, packed.shape[0], dtype=x.dtype, device=x.device)
    start = 0
    for n in row_pieces(padded):
        piece = x[start : start + n]
        out[start : start + n] = torch.ops.mkldnn._linear_pointwise(
            piece, packed, bias, "none", [], ""
        )
        start += n
    return out if padded == rows else out[:rows]


def row_pieces(rows: int) -> list[int]:
    """`rows` as BF16_PIECES-sized pieces, largest first, and a remainder below the smallest."""
    pieces: list[int] = []
    for size in BF16_PIECES:
        while rows >= size:
            pieces.append(size)
            rows -= size
    return [*pieces, rows] if rows else pieces


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """Attention and SwiGLU MLP blocks, each pre-normed with a residual connection. Under
    tensor parallelism (`tp`) it holds its rank's heads and intermediate columns, and sums the
    ranks' partial o_proj and down_proj outputs."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.tp = tp

        def param(*shape: int) -> nn.Parameter:
            return _param(*shape, dtype=dtype, device=device)

        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.eps = c.rms_norm_eps
        self.input_norm = param(c.hidden_size)
        self.qkv_weight = param(c.q_size + 2 * c.kv_size, c.hidden_size)
        self.qkv_bias = param(c.q_size + 2 * c.kv_size) if c.attention_bias else None
        # Qwen3's q_norm and k_norm weights, one row per q head then per kv head: [H + KV, D].
        num_qk = c.num_attention_heads + c.num_key_value_heads
        self.qk_norm = param(num_qk, c.head_dim) if c.qk_norm else None
        self.o_weight = param(c.hidden_size, c.q_size)
        self.o_bias = param(c.hidden_size) if c.o_proj_bias else None
        self.post_norm = param(c.hidden_size)
        self.gate_up_weight = param(2 * c.intermediate_size, c.hidden_size)
        self.down_weight = param(c.hidden_size, c.intermediate_size)
        # oneDNN copies of the four projections (prepack()); None: plain F.linear.
        self.qkv_packed: torch.Tensor | None = None
        self.o_packed: torch.Tensor | None = None
        self.gate_up_packed: torch.Tensor | None = None
        self.down_packed: torch.Tensor | None = None

    def prepack(self, dtype: torch.dtype | None) -> None:
        """Prepacked copies in `dtype` (`pack_dtype`); None drops them."""
        self.qkv_packed = _pack(self.qkv_weight, dtype) if dtype else None
        self.o_packed = _pack(self.o_weight, dtype) if dtype else None
        self.gate_up_packed = _pack(self.gate_up_weight, dtype) if dtype else None
        self.down_packed = _pack(self.down_weight, dtype) if dtype else None

    def forward(
        self,
        layer_idx: int,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        rope: Any,
        attn: AttentionFn,
        ops: TorchOps,
        num_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream `h` `[R, hidden]` plus the previous layer's pending `delta`
        (None for the first layer) -> this layer's (h, delta): each residual add is fused
        with the norm that follows it. `rope` comes from `ops.rope_for`. The first
        `num_tokens` rows are the step's tokens; rows past them (`CausalLM.row_padding`) only
        keep the projections' row counts aligned: attention never sees them."""
        rows = h.shape[0]
        num_qk = self.num_heads + self.num_kv_heads

        h, x = ops.add_rms_norm(h, delta, self.input_norm, self.eps)
        qkv = _linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed)
        qkv = qkv.view(rows, num_qk + self.num_kv_heads, self.head_dim)
        qk = qkv[:, :num_qk]
        if self.qk_norm is not None:
            qk = F.rms_norm(qk, (self.head_dim,), None, self.eps) * self.qk_norm
        qk = ops.rotate(qk, rope)[:num_tokens]
        out = attn(
            layer_idx, qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:num_tokens, num_qk:]
        )
        out = out.reshape(num_tokens, -1)
        if rows != num_tokens:
            out = F.pad(out, (0, 0, 0, rows - num_tokens))
        o = _linear(out, self.o_weight, self.o_bias, self.o_packed)
        if self.tp is not None:
            self.tp.all_reduce(o)

        h, x = ops.add_rms_norm(h, o, self.post_norm, self.eps)
        act = ops.silu_mul(_linear(x, self.gate_up_weight, None, self.gate_up_packed))
        down = _linear(act, self.down_weight, None, self.down_packed)
        if self.tp is not None:
            self.tp.all_reduce(down)
        return h, down

    def load_weights(self, prefix: str, get: TensorSource) -> None:
        """Copy the HF tensors under `prefix` (`model.layers.N.`) into the merged weights."""
        attn = prefix + "self_attn."
        mlp = prefix + "mlp."
        _copy(self.input_norm, get, [prefix + "input_layernorm.weight"])
        _copy(self.post_norm, get, [prefix + "post_attention_layernorm.weight"])
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv_rows = [q_size, kv_size, kv_size]
        _copy(self.qkv_weight, get, [f"{attn}{p}_proj.weight" for p in "qkv"], qkv_rows)
        if self.qkv_bias is not None:
            _copy(self.qkv_bias, get, [f"{attn}{p}_proj.bias" for p in "qkv"], qkv_rows)
        if self.qk_norm is not None:
            shape = (self.head_dim,)
            self.qk_norm[: self.num_heads].copy_(_fetch(get, attn + "q_norm.weight", shape))
            self.qk_norm[self.num_heads :].copy_(_fetch(get, attn + "k_norm.weight", shape))
        _copy(self.o_weight, get, [attn + "o_proj.weight"])
        if self.o_bias is not None:
            _copy(self.o_bias, get, [attn + "o_proj.bias"])
        _copy(self.gate_up_weight, get, [f"{mlp}{p}_proj.weight" for p in ("gate", "up")])
        _copy(self.down_weight, get, [mlp + "down_proj.weight"])


class CausalLM(nn.Module):
    """Decoder-only language model over a flattened token batch."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tp: TensorParallel | None = None,
    ) -> None:
        """With `tp`, the shard of one tensor-parallel rank (`gpu_worker.models.shard`);
        `config` stays the whole model's."""
        super().__init__()
        dev = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.tp = tp
        layer_config = tp.shard.layer_config(config) if tp is not None else config
        vocab_rows = tp.shard.vocab_rows if tp is not None else config.vocab_size
        self.embed = _param(vocab_rows, config.hidden_size, dtype=dtype, device=dev)
        self.layers = nn.ModuleList(
            DecoderLayer(layer_config, dtype, dev, tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = _param(config.hidden_size, dtype=dtype, device=dev)
        self.lm_head = (
            self.embed
            if config.tie_word_embeddings
            else _param(vocab_rows, config.hidden_size, dtype=dtype, device=dev)
        )
        inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self.rope_cache: torch.Tensor
        self.register_buffer(
            "rope_cache",
            cos_sin_table(inv_freq, config.max_model_len, dtype).to(dev),
            persistent=False,
        )
        # Logits in at least float32: sampling and logprobs need more than half precision.
        self.logits_dtype = torch.promote_types(dtype, torch.float32)
        self.ops = ops_for(dtype, dev)
        self.lm_head_packed: torch.Tensor | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        """`input_ids`, `positions` `[T]` long -> final-normed hidden states `[T, hidden]`.

        `positions` must lie in `[0, config.max_model_len)`.
        """
        ops = self.ops
        num_tokens = input_ids.shape[0]
        pad = self.row_padding(num_tokens)
        if pad:
            input_ids = F.pad(input_ids, (0, pad))
            positions = F.pad(positions, (0, pad))
        rope = ops.rope_for(positions, self.rope_cache)
        if self.tp is None:
            h = F.embedding(input_ids, self.embed)
        else:  # this rank's rows of the vocabulary, zeros for the others', summed
            local = input_ids - self.tp.shard.vocab_start
            held = (local >= 0) & (local < self.embed.shape[0])
            h = F.embedding(local.clamp(0, self.embed.shape[0] - 1), self.embed)
            h = self.tp.all_reduce(h * held.unsqueeze(1).to(h.dtype))
        delta = None
        for layer_idx, layer in enumerate(self.layers):
            h, delta = layer(layer_idx, h, delta, rope, attn, ops, num_tokens)
        out = ops.add_rms_norm(h, delta, self.norm, self.config.rms_norm_eps)[1]
        return out[:num_tokens] if pad else out

    def row_padding(self, num_tokens: int) -> int:
        """Rows added past a step's tokens (token 0 at position 0) so that the prepacked bf16
        projections see multiples of `bf16_row_align()` rows: padded once per step here
        rather than by each projection (4 per layer). 0 on every other path."""
        packed = cast(DecoderLayer, self.layers[0]).qkv_packed
        if packed is None or packed.dtype != torch.bfloat16 or packed.dim() == 3:
            return 0  # the CPU team's products take any row count, on AMX tiles too
        return -num_tokens % bf16_row_align()

    def projection_path(self) -> str:
        """How the projections multiply: `F.linear`, `onednn-float32`, `onednn-bfloat16`, or
        `onednn-float32-widened` (a half-precision model's products in float32); `team-...`
        alike on the CPU team's products (`team-bfloat16-amx` on AMX tiles, `-model` on their
        software model)."""
        packed = self.lm_head_packed
        if packed is None:
            return "F.linear"
        kind = "team" if packed.dim() == 3 else "onednn"
        name = f"{kind}-{str(packed.dtype).removeprefix('torch.')}"
        if packed.dim() == 3 and packed.dtype == torch.bfloat16 and cpu_team.tiles() != "off":
            name += f"-{cpu_team.tiles()}"
        return name + "-widened" if packed.dtype != self.dtype else name

    def _packed_in(self, dtype: torch.dtype) -> bool:
        """Whether the prepacked projections are `dtype` copies."""
        first = cast(DecoderLayer, self.layers[0])
        return first.qkv_packed is not None and first.qkv_packed.dtype == dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[R, hidden]` -> `[R, vocab]` in float32 (float64 for a float64 model).

        A half-precision LM head rounds its outputs to 8 significant bits (0.125 apart around
        a logit of 25), which turns near-ties into exact ties and flips greedy choices. So in
        bf16/fp16 the REFINE_TOP largest logits of each row, the tokens greedy picks and
        logprobs list, are recomputed as float32 dot products of the same half-precision
        hidden state and weight rows (exact products, float32 sums); the long tail keeps the
        rounded values, whose error is far below anything sampling can resolve there.
        """
        packed = self.lm_head_packed
        if packed is not None and packed.dtype != self.dtype:
            # Widened: float32 products of the half-precision values, all of them exact already
            # (oneDNN's copy or the CPU team's panels, as `_linear` takes either).
            logits = _linear(hidden.to(packed.dtype), self.lm_head, None, packed)
        elif self.dtype.itemsize < 4:
            logits = _linear(hidden, self.lm_head, None, packed)
            logits, top = self.ops.widen_top(logits, min(REFINE_TOP, logits.shape[1]))  # [R, k]
            self.ops.refine_top(logits, top, hidden, self.lm_head)
        else:
            logits = _linear(hidden, self.lm_head, None, packed).to(self.logits_dtype)
        # Each rank refined its own rows' best: the overall best are among them.
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    @torch.inference_mode()
    def warm_up(self, max_rows: int) -> int:
        """Runs every distinct prepacked projection once for each row count 1..max_rows (in
        bf16: each multiple of `bf16_row_align()` up to max_rows and BF16_PIECES[-1], and each
        size of BF16_PIECES).

        oneDNN builds (and caches) a kernel the first time a projection sees a row count;
        decode batches of every size would otherwise pay for that on their first step. Only
        the prepacked CPU path has such kernels: elsewhere this does nothing. Returns the
        projection calls made.
        """
        layer = cast(DecoderLayer, self.layers[0])
        projections: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = [
            (layer.qkv_weight, layer.qkv_bias, layer.qkv_packed),
            (layer.o_weight, layer.o_bias, layer.o_packed),
            (layer.gate_up_weight, None, layer.gate_up_packed),
            (layer.down_weight, None, layer.down_packed),
            (self.lm_head, None, self.lm_head_packed),
        ]
        counts = set(range(1, max_rows + 1))
        if self._packed_in(torch.bfloat16) and max_rows > 0:
            align = bf16_row_align()
            top = min(-(-max_rows // align) * align, BF16_PIECES[-1])
            counts = {*range(align, top + 1, align), *BF16_PIECES}
        calls = 0
        for weight, bias, packed in projections:
            if packed is None or packed.dim() == 3 or not counts:  # the team compiles nothing
                continue
            x = torch.zeros(max(counts), weight.shape[1], dtype=weight.dtype, device=weight.device)
            for rows in sorted(counts):
                _linear(x[:rows], weight, bias, packed)
                calls += 1
        return calls

    def checkpoint_tensor_names(self) -> list[str]:
        """HF names of every tensor `load_weights` reads."""
        c = self.config
        names = ["model.embed_tokens.weight"]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
            if c.attention_bias:
                names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
            if c.o_proj_bias:
                names.append(f"{p}self_attn.o_proj.bias")
            if c.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
            names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names.append("model.norm.weight")
        if not c.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    @torch.no_grad()
    def load_weights(self, get: TensorSource) -> None:
        """Fill every weight from HF-named checkpoint tensors (cast to the model's dtype);
        under tensor parallelism `get` gives this rank's slices (`Shard.slice`)."""
        _copy(self.embed, get, ["model.embed_tokens.weight"])
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            layer.load_weights(f"model.layers.{i}.", get)
        _copy(self.norm, get, ["model.norm.weight"])
        if not self.config.tie_word_embeddings:
            _copy(self.lm_head, get, ["lm_head.weight"])
        self.prepack()

    @torch.no_grad()
    def prepack(self) -> None:
        """(Re)builds the oneDNN copies of the weights where supported (float32 on a CPU);
        `load_weights` calls it. Call it again after changing weights in place."""
        dtype = pack_dtype(self.dtype, self.embed.device)
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.prepack(dtype)
        self.lm_head_packed = _pack(self.lm_head, dtype) if dtype else None


def _fetch(get: TensorSource, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    tensor = get(name)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


def _copy(
    dst: torch.Tensor, get: TensorSource, names: list[str], rows: list[int] | None = None
) -> None:
    """Fill `dst` with the named tensors stacked along dim 0 (a merged weight when several).

    `rows` gives each tensor's leading size; by default `dst` splits evenly.
    """
    rows = rows or [dst.shape[0] // len(names)] * len(names)
    offset = 0
    for name, n in zip(names, rows, strict=True):
        dst[offset : offset + n].copy_(_fetch(get, name, (n, *dst.shape[1:])))
        offset += n
