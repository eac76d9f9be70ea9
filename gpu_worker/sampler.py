"""The worker's sampler: one next token per row of logits, vectorized over the batch.

Per step, in vLLM's order:

    raw logits ──► logprobs: log_softmax of the raw logits, for rows that ask
        │
        ▼
    penalties: repetition over prompt ∪ output; frequency and presence over output
        │
        ├──► greedy rows: argmax (ties → lowest id)
        └──► random rows: ÷ temperature → min_p → top_k → top_p → one inverse-CDF draw

A random row draws a single uniform u and takes the token whose interval of the cumulative
distribution holds u · total. A seeded row's u comes from a CPU generator seeded with
(seed, len(output_token_ids)) alone, and every step before the draw works row by row with
row-local reductions (max, softmax, sequential cumsum), so its token depends only on its own
logits and parameters: the same whatever else is in the batch, at any row position, and after
a preemption. One uniform per row instead of V exponentials keeps the draw off the profile.

top_p looks for its cut-off among each row's top _TOP_P_WINDOW tokens first, then among the
top _WIDE_WINDOW, and sorts the whole row only when neither holds top_p of the mass.

Features no row uses cost nothing; an all-greedy batch without penalties or logprobs is one
argmax. Logits are float32 or float64 [R, V]; half types are upcast to float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.plan import SampledToken
from pagedserve.sampling_params import SamplingParams

# Temperatures below this sample greedily, as in vLLM: dividing by them can overflow logits.
GREEDY_TEMPERATURE_EPS = 1e-5
# Tokens top_p first searches for its cut-off; peaked distributions need far fewer.
_TOP_P_WINDOW = 64
# Where top_p looks next for rows whose nucleus is wider than the first window.
_WIDE_WINDOW = 1024
# Above this many tokens a partial topk is no cheaper than a full sort.
_MAX_WINDOW = 4096

_MASK64 = (1 << 64) - 1


def is_greedy(sampling: SamplingParams) -> bool:
    return sampling.temperature < GREEDY_TEMPERATURE_EPS


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, output_index: int) -> int:
    """Generator seed for a seeded request's draw of output token `output_index`."""
    return _splitmix64(_splitmix64(seed) ^ output_index)


@dataclass
class SamplingRow:
    """One row of logits to sample from, with the request state the sampler reads."""

    sampling: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far; len() is the index of the token sampled now


@dataclass(frozen=True)
class SamplingMetadata:
    """The batch's sampling parameters as tensors, built once per step.

    Rows split into sub-batches by index tensors; each parameter tensor is aligned with its
    sub-batch. A parameter that is None means no row of its sub-batch uses that feature.
    """

    num_rows: int
    vocab_size: int
    greedy_rows: torch.Tensor  # [G] int64
    random_rows: torch.Tensor  # [N] int64
    # Random rows, aligned with random_rows.
    temperature: torch.Tensor | None  # [N]; None when all are 1
    min_p: torch.Tensor | None  # [N]; 0 disables
    # Random rows with top_k or top_p, as positions in random_rows; their parameters aligned.
    window_rows: torch.Tensor | None  # [F] int64
    top_k: torch.Tensor | None  # [F] int64 in [0, V]; 0 disables
    max_top_k: int  # largest top_k, 0 if none
    top_p: torch.Tensor | None  # [F] float64; 1 disables
    draw_seeds: tuple[int | None, ...]  # [N] draw_seed(), None for rows without a seed
    # Rows with any penalty, aligned with penalty_rows.
    penalty_rows: torch.Tensor | None  # [P] int64
    repetition_penalty: torch.Tensor | None  # [P]
    seen_mask: torch.Tensor | None  # [P, V] bool: token in prompt ∪ output
    frequency_penalty: torch.Tensor | None  # [P]
    presence_penalty: torch.Tensor | None  # [P]
    output_counts: torch.Tensor | None  # [P, V] int32: occurrences in output
    # Rows asking for logprobs, and how many alternatives each wants.
    logprob_rows: tuple[int, ...]
    num_logprobs: tuple[int, ...]

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
    ) -> SamplingMetadata:
        """Raises ValueError when a penalized row holds a token id outside [0, vocab_size)."""
        greedy: list[int] = []
        random_idx: list[int] = []
        penalized: list[int] = []
        logprob_rows: list[int] = []
        num_logprobs: list[int] = []
        for i, row in enumerate(rows):
            sp = row.sampling
            (greedy if is_greedy(sp) else random_idx).append(i)
            if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty:
                penalized.append(i)
            if sp.logprobs is not None:
                logprob_rows.append(i)
                num_logprobs.append(sp.logprobs)

        def vec(values: list[float], vec_dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=vec_dtype, device=device)

        def idx(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        rand = [rows[i] for i in random_idx]
        params = [r.sampling for r in rand]
        windowed = [p for p in params if p.top_k > 0 or p.top_p < 1.0]
        top_k = [min(p.top_k, vocab_size) for p in windowed]
        penalties = _PenaltyTensors.build([rows[i] for i in penalized], vocab_size, device, dtype)
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            greedy_rows=idx(greedy),
            random_rows=idx(random_idx),
            temperature=(
                vec([p.temperature for p in params])
                if any(p.temperature != 1.0 for p in params)
                else None
            ),
            min_p=vec([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
            window_rows=(
                idx([i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0])
                if windowed
                else None
            ),
            top_k=idx(top_k) if any(top_k) else None,
            max_top_k=max(top_k, default=0),
            top_p=(
                vec([p.top_p for p in windowed], torch.float64)
                if any(p.top_p < 1.0 for p in windowed)
                else None
            ),
            draw_seeds=tuple(
                None
                if r.sampling.seed is None
                else draw_seed(r.sampling.seed, len(r.output_token_ids))
                for r in rand
            ),
            penalty_rows=idx(penalized) if penalized else None,
            repetition_penalty=penalties.repetition,
            seen_mask=penalties.seen_mask,
            frequency_penalty=penalties.frequency,
            presence_penalty=penalties.presence,
            output_counts=penalties.output_counts,
            logprob_rows=tuple(logprob_rows),
            num_logprobs=tuple(num_logprobs),
        )


@dataclass(frozen=True)
class _PenaltyTensors:
    repetition: torch.Tensor | None = None
    seen_mask: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        rows: list[SamplingRow],
        vocab_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> _PenaltyTensors:
        if not rows:
            return cls()
        params = [r.sampling for r in rows]
        size = len(rows) * vocab_size
        output_ids = _flat_token_ids([r.output_token_ids for r in rows], vocab_size, device)
        repetition = seen = None
        if any(p.repetition_penalty != 1.0 for p in params):
            prompt_ids = _flat_token_ids([r.prompt_token_ids for r in rows], vocab_size, device)
            seen = torch.zeros(size, dtype=torch.bool, device=device)
            seen[prompt_ids] = True
            seen[output_ids] = True
            seen = seen.view(len(rows), vocab_size)
            rp = [p.repetition_penalty for p in params]
            repetition = torch.tensor(rp, dtype=dtype, device=device)
        if not any(p.frequency_penalty or p.presence_penalty for p in params):
            return cls(repetition=repetition, seen_mask=seen)
        counts = torch.zeros(size, dtype=torch.int32, device=device)
        counts.scatter_add_(0, output_ids, torch.ones_like(output_ids, dtype=torch.int32))
        freq = [p.frequency_penalty for p in params]
        presence = [p.presence_penalty for p in params]
        return cls(
            repetition=repetition,
            seen_mask=seen,
            frequency=torch.tensor(freq, dtype=dtype, device=device),
            presence=torch.tensor(presence, dtype=dtype, device=device),
            output_counts=counts.view(len(rows), vocab_size),
        )


def _flat_token_ids(
    per_row: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """Token ids of every row as indices into a flattened [rows, vocab_size] tensor."""
    ids = torch.cat([torch.tensor(t, dtype=torch.long) for t in per_row])
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token id out of range [0, {vocab_size})")
    lengths = torch.tensor([len(t) for t in per_row])
    offsets = torch.arange(len(per_row), dtype=torch.long) * vocab_size
    return (ids + offsets.repeat_interleave(lengths)).to(device)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Penalized copy of logits [R, V]; returns logits itself when no row has penalties."""
    if meta.penalty_rows is None:
        return logits
    sub = logits.index_select(0, meta.penalty_rows)
    if meta.repetition_penalty is not None and meta.seen_mask is not None:
        penalty = torch.where(meta.seen_mask, meta.repetition_penalty[:, None], 1.0)
        sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    if meta.output_counts is not None:
        assert meta.frequency_penalty is not None and meta.presence_penalty is not None
        counts = meta.output_counts
        sub -= meta.frequency_penalty[:, None] * counts
        sub -= meta.presence_penalty[:, None] * (counts > 0)
    return logits.index_copy(0, meta.penalty_rows, sub)


def sampling_probs(
    logits: torch.Tensor, meta: SamplingMetadata, *, scratch: bool = False
) -> torch.Tensor:
    """The distribution random rows draw from, up to a per-row scale: [N, V], 0 = filtered.

    logits are the random rows' penalized logits [N, V]. After temperature, min_p drops tokens
    whose probability is below min_p times the top one; top_k keeps tokens at least as likely
    as the k-th (ties kept); top_p, over what those two kept, keeps the smallest set of most
    likely tokens whose mass reaches top_p (ties with its least likely member kept), and
    always the top token. Each filter is a probability threshold; a row keeps the tokens at
    or above the largest of its thresholds. With scratch=True logits may be overwritten.
    """
    # Fresh [N, V] tensors are costly on CPU (page faults), so owned ones are reused in place.
    x = logits
    if meta.temperature is not None:
        t = meta.temperature[:, None]
        x = x.div_(t) if scratch else x / t
    # softmax works row by row, unlike a batched exp whose SIMD tail depends on the batch.
    probs = x.softmax(dim=-1)
    if meta.min_p is None and meta.window_rows is None:
        return probs
    threshold = torch.zeros(probs.shape[0], dtype=probs.dtype, device=probs.device)
    if meta.min_p is not None:
        threshold = probs.amax(dim=-1) * meta.min_p
    if meta.window_rows is not None:
        rows = meta.window_rows
        threshold[rows] = _window_threshold(probs.index_select(0, rows), threshold[rows], meta)
    return probs.mul_(probs >= threshold[:, None])


def _window_threshold(
    probs: torch.Tensor, threshold: torch.Tensor, meta: SamplingMetadata
) -> torch.Tensor:
    """Raises each row's threshold [F] by its top_k and top_p; probs [F, V]."""
    vocab_size = probs.shape[1]
    width = max(meta.max_top_k, _TOP_P_WINDOW if meta.top_p is not None else 0)
    if width > min(_MAX_WINDOW, vocab_size // 4):
        top = probs.sort(dim=-1, descending=True).values
    else:
        top = probs.topk(width, dim=-1).values
    if meta.top_k is not None:
        kth = top.gather(1, (meta.top_k.clamp(min=1) - 1)[:, None]).squeeze(1)
        threshold = torch.where(meta.top_k > 0, torch.maximum(threshold, kth), threshold)
    if meta.top_p is None:
        return threshold
    return torch.maximum(threshold, _top_p_threshold(probs, top, threshold, meta.top_p))


def _top_p_threshold(
    probs: torch.Tensor, top: torch.Tensor, threshold: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Probability of the least likely token top_p keeps, per row; 0 where disabled.

    probs [F, V]; top [F, W] the W largest of each row, descending; threshold [F] what min_p
    and top_k already drop below. top_p's mass is relative to what they keep.
    """
    # Masses are sequential float64 cumsums, in id order here and in descending order below:
    # the same bits for a row whatever the batch or the window's width.
    kept_mass = torch.ones_like(top_p)
    filtered = ((threshold > 0) & (top_p < 1)).nonzero().squeeze(1)
    if filtered.numel():
        p = probs.index_select(0, filtered)
        kept = torch.where(p >= threshold[filtered, None], p, 0.0)
        kept_mass[filtered] = kept.double().cumsum(dim=-1)[:, -1]
    goal = top_p * kept_mass
    cutoff, reached = _cutoff_in(top, threshold, goal)
    missed = (~reached & (top_p < 1)).nonzero().squeeze(1)
    # Rows whose nucleus is wider than the window look again in a wider one, then the whole row.
    vocab_size, width = probs.shape[1], top.shape[1]
    while missed.numel() and width < vocab_size:
        width = _WIDE_WINDOW if width < _WIDE_WINDOW <= vocab_size // 4 else vocab_size
        rows = probs.index_select(0, missed)
        if width < vocab_size:
            wide = rows.topk(width, dim=-1).values
        else:
            wide = rows.sort(dim=-1, descending=True).values
        cutoff[missed], reached = _cutoff_in(wide, threshold[missed], goal[missed])
        missed = missed[~reached]
    return cutoff.masked_fill(top_p >= 1, 0.0)


def _cutoff_in(
    top: torch.Tensor, threshold: torch.Tensor, goal: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """First value of each descending row of top whose running kept mass reaches goal, and
    whether the row reached it at all (else its last value)."""
    kept = torch.where(top >= threshold[:, None], top, 0.0)
    mass = kept.double().cumsum(dim=-1)
    last = (mass < goal[:, None]).sum(dim=-1).clamp(max=top.shape[1] - 1)
    return top.gather(1, last[:, None]).squeeze(1), mass[:, -1] >= goal


def argmax(logits: torch.Tensor, block: int = 512) -> torch.Tensor:
    """Per-row argmax of [R, V], the lowest id among ties, as torch.argmax.

    On CPU torch.argmax is several times slower than a max-reduction, so the row's block of
    `block` tokens holding the maximum is found with amax first, then searched alone.
    """
    rows, vocab = logits.shape
    num_blocks = vocab // block
    if logits.device.type != "cpu" or num_blocks < 2 or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    head_size = num_blocks * block
    head = logits[:, :head_size].view(rows, num_blocks, block)
    block_max = head.amax(dim=-1)  # [R, num_blocks]
    best = block_max.argmax(dim=-1)  # the first block holding the head's maximum
    in_block = head[torch.arange(rows, device=logits.device), best].argmax(dim=-1)
    token_ids = best * block + in_block
    if head_size < vocab:
        tail_max, tail_ids = logits[:, head_size:].max(dim=-1)
        head_max = block_max.gather(1, best[:, None]).squeeze(1)
        token_ids = torch.where(tail_max > head_max, head_size + tail_ids, token_ids)
    return token_ids


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: per row, the token whose cumulative interval holds u · total mass.

    probs [N, V] non-negative, any scale; u [N] float64 in [0, 1). Zero-probability tokens
    have empty intervals and are never drawn.
    """
    # Converting first is several times faster than cumsum(dtype=float64) on CPU.
    cdf = probs.double().cumsum_(dim=-1)
    total = cdf[:, -1]
    # u · total may round up to total; the largest float below it still lands in the last
    # non-empty interval.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    token_ids = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    return token_ids.clamp_(max=probs.shape[1] - 1)


class Sampler:
    """Picks one token per row of logits; see the module docstring for the order of steps.

    Rows without a seed draw from one CPU generator shared by the batch: the Sampler's own
    when it is given a seed, else torch's default generator.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._shared: torch.Generator | None = None
        if seed is not None:
            self._shared = torch.Generator().manual_seed(seed)
        self._seeded = torch.Generator()

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """logits [R, V] float, one row per entry of rows. Does not modify logits."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
        if logits.shape[0] != len(rows):
            raise ValueError(f"logits have {logits.shape[0]} rows for {len(rows)} sampling rows")
        if not logits.is_floating_point():
            raise TypeError(f"logits must be floating point, got {logits.dtype}")
        if not rows:
            return []
        if logits.shape[1] == 0:
            raise ValueError("logits have an empty vocabulary")
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        meta = SamplingMetadata.build(rows, logits.shape[1], logits.device, logits.dtype)
        return self.sample(logits, meta)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> list[SampledToken]:
        """Sample with prebuilt metadata; logits [R, V] float32 or float64, not modified."""
        token_ids = self._sample_token_ids(logits, meta)
        tokens = [SampledToken(t) for t in token_ids.tolist()]
        if meta.logprob_rows:
            _fill_logprobs(tokens, logits, token_ids, meta)
        return tokens

    def _sample_token_ids(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = apply_penalties(logits, meta)
        num_random = meta.random_rows.numel()
        if num_random == 0:
            return argmax(logits)
        if num_random == meta.num_rows:
            # apply_penalties made a copy, or logits are still the caller's.
            return self._sample_random(logits, meta, scratch=meta.penalty_rows is not None)
        token_ids = torch.empty(meta.num_rows, dtype=torch.long, device=logits.device)
        token_ids[meta.greedy_rows] = argmax(logits.index_select(0, meta.greedy_rows))
        random_logits = logits.index_select(0, meta.random_rows)
        token_ids[meta.random_rows] = self._sample_random(random_logits, meta, scratch=True)
        return token_ids

    def _sample_random(
        self, logits: torch.Tensor, meta: SamplingMetadata, scratch: bool
    ) -> torch.Tensor:
        probs = sampling_probs(logits, meta, scratch=scratch)
        u = torch.rand(len(meta.draw_seeds), dtype=torch.float64, generator=self._shared)
        for i, seed in enumerate(meta.draw_seeds):
            if seed is not None:
                self._seeded.manual_seed(seed)
                u[i] = torch.rand(1, dtype=torch.float64, generator=self._seeded)
        return draw(probs, u.to(probs.device))


def _fill_logprobs(
    tokens: list[SampledToken],
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    meta: SamplingMetadata,
) -> None:
    rows = torch.tensor(meta.logprob_rows, dtype=torch.long, device=logits.device)
    logprobs = logits.index_select(0, rows).log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[rows][:, None]).squeeze(1).tolist()
    k = min(max(meta.num_logprobs), meta.vocab_size)
    top_values: list[list[float]] = [[] for _ in meta.logprob_rows]
    top_ids: list[list[int]] = [[] for _ in meta.logprob_rows]
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for j, (row, n) in enumerate(zip(meta.logprob_rows, meta.num_logprobs, strict=True)):
        tok = tokens[row]
        tok.logprob = chosen[j]
        tok.top_token_ids = top_ids[j][:n]
        tok.top_logprobs = top_values[j][:n]
