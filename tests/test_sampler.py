"""Sampler tests: each feature against a slow per-row reference, seeded reproducibility, and
the batch as a whole."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gpu_worker.sampler import (
    GREEDY_TEMPERATURE_EPS,
    Sampler,
    SamplingMetadata,
    SamplingRow,
    apply_penalties,
    argmax,
    draw_seed,
    sampling_probs,
)
from pagedserve.sampling_params import SamplingParams

FAST = settings(max_examples=60, deadline=None)


def make_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def row(
    sampling: SamplingParams | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    **kwargs: object,
) -> SamplingRow:
    sp = sampling if sampling is not None else SamplingParams(**kwargs)  # type: ignore[arg-type]
    return SamplingRow(sp, list(prompt or []), list(output or []))


# --- slow references, one row at a time ------------------------------------------------------


def ref_penalize(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    out = logits.clone()
    sp = r.sampling
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        v = float(out[t])
        out[t] = v / sp.repetition_penalty if v > 0 else v * sp.repetition_penalty
    for t, c in Counter(r.output_token_ids).items():
        out[t] -= sp.frequency_penalty * c + sp.presence_penalty
    return out


def require(condition: bool) -> None:
    assert condition, "a token sits on a filter boundary; pick other logits"


def ref_distribution(
    logits: torch.Tensor,
    sp: SamplingParams,
    margin: float = 1e-4,
    clear_of_boundaries: Callable[[bool], object] = assume,
) -> torch.Tensor:
    """Filtered, normalized distribution of one random row, in float64. Passes False to
    `clear_of_boundaries` when some token sits within `margin` of a filter's boundary, where
    float32 rounding may fairly decide either way."""
    x = logits.double() / sp.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if sp.min_p > 0:
        p = x.softmax(-1)
        bound = sp.min_p * p.max()
        clear_of_boundaries(not bool(((p - bound).abs() < margin * p.max()).any()))
        keep &= p >= bound
    if sp.top_k > 0:
        kth = x.sort(descending=True).values[min(sp.top_k, len(x)) - 1]
        near = ((x - kth).abs() < margin) & (x != kth)
        clear_of_boundaries(not bool(near.any()))
        keep &= x >= kth
    x = x.masked_fill(~keep, -math.inf)
    if sp.top_p < 1:
        p = x.softmax(-1)
        order = p.argsort(descending=True, stable=True)
        mass_before = 0.0
        top_keep = torch.zeros_like(keep)
        for i in order.tolist():
            if mass_before >= sp.top_p:
                clear_of_boundaries(mass_before - sp.top_p > margin)
                break
            clear_of_boundaries(sp.top_p - mass_before > margin)
            top_keep[i] = True
            mass_before += float(p[i])
        # Ties with the least likely kept token stay.
        top_keep |= keep & (p >= p[top_keep].min())
        keep &= top_keep
        x = x.masked_fill(~keep, -math.inf)
    return x.softmax(-1)


# --- hypothesis strategies -------------------------------------------------------------------

temperatures = st.one_of(st.just(1.0), st.floats(0.05, 3.0))
random_params = st.builds(
    SamplingParams,
    temperature=temperatures,
    top_k=st.one_of(st.just(0), st.integers(1, 40)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 0.99)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.5)),
)
penalty_params = st.builds(
    SamplingParams,
    temperature=st.just(0.0),
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.5, 2.0)),
    frequency_penalty=st.floats(-2.0, 2.0),
    presence_penalty=st.floats(-2.0, 2.0),
)


# --- greedy ----------------------------------------------------------------------------------


@FAST
@given(rows=st.integers(1, 8), vocab=st.integers(1, 3000), seed=st.integers(0, 2**31))
def test_greedy_is_argmax(rows: int, vocab: int, seed: int) -> None:
    logits = make_logits(rows, vocab, seed)
    tokens = Sampler()(logits, [row(temperature=0.0) for _ in range(rows)])
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()
    assert all(t.logprob is None and t.top_token_ids == [] for t in tokens)


@FAST
@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 70),
    block=st.integers(1, 9),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**31),
)
def test_blocked_argmax_matches_torch(
    rows: int, vocab: int, block: int, levels: int, seed: int
) -> None:
    # Few distinct values: ties everywhere, across block boundaries and into the tail.
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).float()
    logits[logits == 0] = -math.inf
    assert torch.equal(argmax(logits, block=block), logits.argmax(dim=-1))


def test_greedy_ties_pick_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    tokens = Sampler()(logits, [row(temperature=0.0), row(temperature=0.0)])
    assert [t.token_id for t in tokens] == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_float_dtypes(dtype: torch.dtype) -> None:
    logits = make_logits(4, 50, 0).to(dtype)
    tokens = Sampler()(logits, [row(temperature=0.0) for _ in range(4)])
    assert [t.token_id for t in tokens] == logits.float().argmax(-1).tolist()
    random_tokens = Sampler(seed=0)(logits, [row(top_p=0.5) for _ in range(4)])
    assert all(0 <= t.token_id < 50 for t in random_tokens)


# --- penalties -------------------------------------------------------------------------------


@FAST
@given(
    params=st.lists(penalty_params, min_size=1, max_size=6),
    vocab=st.integers(1, 60),
    data=st.data(),
    seed=st.integers(0, 2**31),
)
def test_penalties_match_reference(
    params: list[SamplingParams], vocab: int, data: st.DataObject, seed: int
) -> None:
    ids = st.lists(st.integers(0, vocab - 1), max_size=30)
    rows = [row(sp, data.draw(ids), data.draw(ids)) for sp in params]
    logits = make_logits(len(rows), vocab, seed)
    meta = SamplingMetadata.build(rows, vocab, "cpu")
    got = apply_penalties(logits, meta)
    want = torch.stack([ref_penalize(logits[i], r) for i, r in enumerate(rows)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Greedy rows take the argmax of the penalized logits.
    tokens = Sampler()(logits, rows)
    for i, t in enumerate(tokens):
        assert float(want[i, t.token_id]) >= float(want[i].max()) - 1e-4


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    r = row(prompt=[0], output=[1], temperature=0.0, repetition_penalty=2.0)
    got = apply_penalties(logits, SamplingMetadata.build([r], 4, "cpu"))
    assert got.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_frequency_and_presence_count_output_only() -> None:
    logits = torch.zeros(1, 4)
    r = row(
        prompt=[3, 3],
        output=[0, 0, 0, 1],
        temperature=0.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    got = apply_penalties(logits, SamplingMetadata.build([r], 4, "cpu"))
    assert got.tolist() == [[-1.75, -0.75, 0.0, 0.0]]


def test_penalties_leave_other_rows_and_input_alone() -> None:
    logits = make_logits(3, 10, 1)
    before = logits.clone()
    rows = [row(temperature=0.0), row(output=[1, 2], frequency_penalty=1.0), row()]
    got = apply_penalties(logits, SamplingMetadata.build(rows, 10, "cpu"))
    assert torch.equal(logits, before)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[1], logits[1])


# --- filters ---------------------------------------------------------------------------------


@FAST
@given(params=random_params, vocab=st.integers(1, 120), seed=st.integers(0, 2**31))
def test_filters_match_reference(params: SamplingParams, vocab: int, seed: int) -> None:
    logits = make_logits(1, vocab, seed)
    want = ref_distribution(logits[0], params)
    meta = SamplingMetadata.build([row(params)], vocab, "cpu")
    got = sampling_probs(logits, meta)[0].double()
    # float32 may underflow what float64 keeps; it must never keep what the reference drops.
    assert not bool(((got > 0) & (want == 0)).any())
    assert not bool(((got == 0) & (want > 1e-30)).any())
    torch.testing.assert_close(got / got.sum(), want, rtol=1e-4, atol=1e-6)


@FAST
@given(params=random_params, vocab=st.integers(2, 80), seed=st.integers(0, 2**31))
def test_draws_never_pick_a_filtered_token(params: SamplingParams, vocab: int, seed: int) -> None:
    logits = make_logits(1, vocab, seed).expand(256, vocab)
    allowed = ref_distribution(logits[0], params) > 0
    tokens = Sampler(seed=seed)(logits, [row(params)] * 256)
    assert all(bool(allowed[t.token_id]) for t in tokens)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.6),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=1.5, top_k=8, top_p=0.8, min_p=0.05),
    ],
)
def test_empirical_frequencies_follow_filtered_distribution(params: SamplingParams) -> None:
    vocab, draws = 16, 20_000
    logits = make_logits(1, vocab, 7, scale=1.5)
    want = ref_distribution(logits[0], params, clear_of_boundaries=require)
    tokens = Sampler(seed=1)(logits.expand(draws, vocab), [row(params)] * draws)
    counts = torch.bincount(torch.tensor([t.token_id for t in tokens]), minlength=vocab)
    freq = counts.double() / draws
    assert bool((freq[want == 0] == 0).all())
    assert float((freq - want).abs().max()) < 0.015


def test_top_p_always_keeps_the_top_token() -> None:
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3]])
    meta = SamplingMetadata.build([row(top_p=0.01)], 4, "cpu")
    probs = sampling_probs(logits, meta)
    assert (probs > 0).tolist() == [[False, False, False, True]]


@pytest.mark.parametrize("vocab, likely", [(1000, 100), (8000, 300), (8000, 3000)])
def test_top_p_looks_past_the_first_window(vocab: int, likely: int) -> None:
    # top_p needs ~90% of the `likely` tokens: past the first window, then past the wide one.
    logits = torch.cat([torch.linspace(8.5, 8.0, likely), torch.zeros(vocab - likely)])[None]
    params = SamplingParams(top_p=0.9)
    want = ref_distribution(logits[0], params, margin=1e-6, clear_of_boundaries=require)
    got = sampling_probs(logits, SamplingMetadata.build([row(params)], vocab, "cpu"))[0]
    assert 64 < int((want > 0).sum()) < likely
    assert torch.equal(got > 0, want > 0)


# --- temperature -----------------------------------------------------------------------------


def test_temperature_below_eps_is_greedy() -> None:
    logits = make_logits(8, 100, 3)
    rows = [row(temperature=GREEDY_TEMPERATURE_EPS / 2) for _ in range(8)]
    assert [t.token_id for t in Sampler()(logits, rows)] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-3, GREEDY_TEMPERATURE_EPS])
def test_small_temperature_approaches_argmax(temperature: float) -> None:
    logits = torch.randperm(500, generator=torch.Generator().manual_seed(0)).float()[None] * 0.1
    logits = logits.expand(64, 500) * 100  # gaps of 10: finite after dividing by 1e-5
    tokens = Sampler(seed=0)(logits, [row(temperature=temperature)] * 64)
    assert {t.token_id for t in tokens} == {int(logits[0].argmax())}


def test_high_temperature_flattens() -> None:
    logits = make_logits(1, 4, 0).expand(4000, 4)
    tokens = Sampler(seed=0)(logits, [row(temperature=1e4)] * 4000)
    counts = Counter(t.token_id for t in tokens)
    assert len(counts) == 4 and min(counts.values()) > 850


# --- seeds -----------------------------------------------------------------------------------

SEEDED_KINDS = [
    SamplingParams(seed=0),
    SamplingParams(seed=0, temperature=0.6, top_p=0.9),
    SamplingParams(seed=0, top_k=7),
    SamplingParams(seed=0, min_p=0.1, top_k=30, top_p=0.95),
]
NEIGHBOURS = [
    SamplingParams(),
    SamplingParams(top_k=900),  # too wide for a window: forces the full-sort path
    SamplingParams(top_p=0.3, temperature=2.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(min_p=0.3, seed=99),
]


@settings(max_examples=40, deadline=None)
@given(
    kind=st.integers(0, len(SEEDED_KINDS) - 1),
    seed=st.integers(0, 2**63 - 1),
    index=st.integers(0, 5000),
    neighbours=st.lists(st.integers(0, len(NEIGHBOURS) - 1), max_size=6),
    position=st.integers(0, 6),
    logits_seed=st.integers(0, 2**31),
)
def test_seeded_row_is_the_same_alone_and_in_any_batch(
    kind: int, seed: int, index: int, neighbours: list[int], position: int, logits_seed: int
) -> None:
    vocab = 1001  # odd, so rows sit at every alignment
    sp = dataclasses.replace(SEEDED_KINDS[kind], seed=seed)
    mine = row(sp, [1, 2], [5] * index)
    my_logits = make_logits(1, vocab, logits_seed)
    alone = Sampler(seed=1)(my_logits, [mine])[0].token_id

    others = [row(NEIGHBOURS[n], [3], [4]) for n in neighbours]
    position = min(position, len(others))
    rows = others[:position] + [mine] + others[position:]
    logits = make_logits(len(rows), vocab, logits_seed + 1)
    logits[position] = my_logits[0]
    in_batch = Sampler(seed=2)(logits, rows)[position].token_id
    assert in_batch == alone

    # Row-local arithmetic: the filtered distribution is bitwise the same too.
    meta_alone = SamplingMetadata.build([mine], vocab, "cpu")
    meta_batch = SamplingMetadata.build(rows, vocab, "cpu")
    batch_position = meta_batch.random_rows.tolist().index(position)
    random_logits = apply_penalties(logits, meta_batch)[meta_batch.random_rows]
    assert torch.equal(
        sampling_probs(my_logits, meta_alone)[0],
        sampling_probs(random_logits, meta_batch)[batch_position],
    )


def test_seeded_stream_survives_a_new_sampler() -> None:
    # A preempted request resumes on fresh state with its output so far; its draws repeat.
    logits = torch.zeros(1, 1000)
    stream = [Sampler()(logits, [row(seed=42, output=[0] * i)])[0].token_id for i in range(10)]
    again = [Sampler()(logits, [row(seed=42, output=[0] * i)])[0].token_id for i in range(10)]
    assert stream == again


def test_different_seeds_give_different_streams() -> None:
    logits = torch.zeros(1, 1000)

    def stream(seed: int) -> list[int]:
        sampler = Sampler()
        return [sampler(logits, [row(seed=seed, output=[0] * i)])[0].token_id for i in range(20)]

    assert stream(1) != stream(2)
    assert len({tuple(stream(s)) for s in range(5)}) == 5


def test_same_seed_different_index_draws_differently() -> None:
    logits = torch.zeros(1, 1000)
    sampler = Sampler()
    tokens = [sampler(logits, [row(seed=7, output=[0] * i)])[0].token_id for i in range(30)]
    assert len(set(tokens)) > 20
    assert draw_seed(7, 0) != draw_seed(7, 1) != draw_seed(8, 1)


def test_unseeded_rows_follow_the_sampler_generator() -> None:
    logits = torch.zeros(16, 1000)
    rows = [row() for _ in range(16)]
    first = [t.token_id for t in Sampler(seed=5)(logits, rows)]
    assert first == [t.token_id for t in Sampler(seed=5)(logits, rows)]
    assert first != [t.token_id for t in Sampler(seed=6)(logits, rows)]


# --- logprobs --------------------------------------------------------------------------------


@FAST
@given(
    k=st.integers(0, 20),
    vocab=st.integers(1, 100),
    temperature=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_logprobs_match_raw_log_softmax(k: int, vocab: int, temperature: float, seed: int) -> None:
    logits = make_logits(2, vocab, seed)
    # Penalties and temperature shape the choice, not the reported logprobs.
    r = row(
        prompt=[0],
        output=[vocab - 1],
        temperature=temperature,
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        logprobs=k,
        seed=seed,
    )
    tokens = Sampler()(logits, [r, row(temperature=temperature, logprobs=k)])
    raw = torch.log_softmax(logits, -1)
    for i, t in enumerate(tokens):
        assert t.logprob == pytest.approx(float(raw[i, t.token_id]), abs=1e-6)
        n = min(k, vocab)
        assert len(t.top_token_ids) == len(t.top_logprobs) == n
        assert t.top_logprobs == sorted(t.top_logprobs, reverse=True)
        torch.testing.assert_close(
            torch.tensor(t.top_logprobs), raw[i].topk(n).values, rtol=0, atol=1e-6
        )
        assert [float(raw[i, j]) for j in t.top_token_ids] == pytest.approx(t.top_logprobs)


def test_logprobs_only_for_rows_that_ask() -> None:
    logits = make_logits(3, 30, 0)
    rows = [row(temperature=0.0), row(temperature=0.0, logprobs=0), row(logprobs=3)]
    tokens = Sampler(seed=0)(logits, rows)
    assert tokens[0].logprob is None
    assert tokens[1].logprob is not None and tokens[1].top_token_ids == []
    assert len(tokens[2].top_token_ids) == 3


# --- the whole batch -------------------------------------------------------------------------


def test_mixed_batch() -> None:
    vocab = 500
    rows = [
        row(temperature=0.0),
        row(top_p=0.8, temperature=0.7),
        row(
            prompt=[1, 2, 3],
            output=[4, 4],
            temperature=0.0,
            repetition_penalty=1.2,
            frequency_penalty=0.3,
            presence_penalty=0.3,
            logprobs=4,
        ),
        row(seed=11, top_k=20, logprobs=0),
        row(prompt=[9], output=[9, 8], min_p=0.1, repetition_penalty=0.9, logprobs=2),
        row(temperature=0.0, logprobs=1),
    ]
    logits = make_logits(len(rows), vocab, 5)
    before = logits.clone()
    tokens = Sampler(seed=3)(logits, rows)
    assert torch.equal(logits, before)
    assert len(tokens) == len(rows)

    penalized = torch.stack([ref_penalize(logits[i], r) for i, r in enumerate(rows)])
    for i in (0, 2, 5):
        assert tokens[i].token_id == int(penalized[i].argmax())
    for i in (1, 3, 4):
        dist = ref_distribution(penalized[i], rows[i].sampling, clear_of_boundaries=require)
        assert float(dist[tokens[i].token_id]) > 0
    assert tokens[3].token_id == Sampler()(logits[3:4], [rows[3]])[0].token_id
    raw = torch.log_softmax(logits, -1)
    for i, r in enumerate(rows):
        if r.sampling.logprobs is None:
            assert tokens[i].logprob is None
        else:
            assert tokens[i].logprob == pytest.approx(float(raw[i, tokens[i].token_id]))
            assert len(tokens[i].top_token_ids) == r.sampling.logprobs


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0.5, top_p=0.9, min_p=0.1)] * 3,
        [SamplingParams(temperature=0.5, frequency_penalty=1.0)] * 3,
        [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=3)] * 2,
    ],
)
def test_logits_are_not_modified(params: list[SamplingParams]) -> None:
    logits = make_logits(len(params), 40, 2)
    before = logits.clone()
    Sampler(seed=0)(logits, [row(sp, [1], [2, 3]) for sp in params])
    assert torch.equal(logits, before)


def test_empty_batch() -> None:
    assert Sampler()(torch.empty(0, 10), []) == []


@pytest.mark.parametrize(
    "logits, num_rows, error",
    [
        (torch.zeros(10), 1, ValueError),
        (torch.zeros(1, 2, 10), 1, ValueError),
        (torch.zeros(2, 10), 3, ValueError),
        (torch.zeros(2, 10, dtype=torch.long), 2, TypeError),
        (torch.zeros(2, 0), 2, ValueError),
    ],
)
def test_invalid_shapes_raise(logits: torch.Tensor, num_rows: int, error: type[Exception]) -> None:
    with pytest.raises(error):
        Sampler()(logits, [row() for _ in range(num_rows)])


@pytest.mark.parametrize("bad_id", [-1, 10])
def test_out_of_range_token_ids_raise(bad_id: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        Sampler()(torch.zeros(1, 10), [row(output=[bad_id], presence_penalty=1.0)])
    with pytest.raises(ValueError, match="out of range"):
        Sampler()(torch.zeros(1, 10), [row(prompt=[bad_id], repetition_penalty=1.1)])
