"""Beam search against transformers' generate(num_beams=W) on the same float64 weights: the
same sequences in the same order with the same scores, with the beams' blocks shared and copied
on write, under preemption by swap and by recompute, and across a lost worker."""

from __future__ import annotations

import json
import random
import shutil
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from control_plane.beam import BeamGroup
from control_plane.block_manager import BlockManager
from control_plane.request import Request
from control_plane.scheduler import Scheduler, SchedulerConfig
from gpu_worker.attention import create_backend
from gpu_worker.checkpoint import load_model
from gpu_worker.kv_cache import CacheGeometry, KVCache
from gpu_worker.model_init import EOS_ID
from gpu_worker.model_runner import ModelRunner
from pagedserve.cli.model_source import ensure_default_model
from pagedserve.grammar import GrammarCompiler, allowed_tokens, vocab_tokenizer
from pagedserve.sampling_params import InvalidRequestError, SamplingParams, StructuredOutput
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb
from tests.procs import ServerProcess
from tests.stack import request, start_stack

BLOCK_SIZE = 16
SCORE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Case:
    width: int
    num_return: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int
    prompt: tuple[int, ...]
    eos_raised: bool  # on the checkpoint whose EOS logit is scaled up: early, uneven finishes
    structured: StructuredOutput | None = None

    def sampling(self, **kw: Any) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_new_tokens,
            temperature=0.0,
            n=self.num_return,
            beam_width=self.width,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            structured=self.structured,
            **kw,
        )


Result = list[tuple[list[int], float, str]]  # (generated ids, score, finish reason), best first


def _cases() -> list[Case]:
    rng = random.Random(12)
    lengths = [1, 2, 7, 16, 17, 31, 48, 64, 95, 120, 160, 200]
    cases = []
    i = 0
    for width in (2, 4, 6):
        for length_penalty in (0.5, 1.0, 2.0):
            for early_stopping in (False, True, "never"):
                n = lengths[i % len(lengths)]
                cases.append(
                    Case(
                        width=width,
                        num_return=1 + i % width,  # mostly fewer than the width
                        length_penalty=length_penalty,
                        early_stopping=early_stopping,
                        max_new_tokens=6 + i % 11,
                        prompt=tuple(rng.randrange(3, 512) for _ in range(n)),
                        eos_raised=i % 3 != 2,
                    )
                )
                i += 1
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def checkpoints(micro_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """The micro checkpoint, and a copy whose EOS row of the LM head is scaled by 2.5: EOS is
    then the likeliest token in about one context in eight, so hypotheses finish early, at
    different lengths."""
    from safetensors.torch import load_file, save_file

    raised = tmp_path_factory.mktemp("eos-raised") / "model"
    shutil.copytree(micro_llama, raised)
    weights = load_file(raised / "model.safetensors")
    weights["lm_head.weight"][EOS_ID] *= 2.5
    save_file(weights, raised / "model.safetensors")
    return {False: micro_llama, True: raised}


@pytest.fixture(scope="module")
def expected(checkpoints: dict[bool, Path]) -> dict[Case, Result]:
    import transformers

    out: dict[Case, Result] = {}
    for raised, path in checkpoints.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        for case in (c for c in CASES if c.eos_raised == raised):
            out[case] = hf_beam_search(model, case)
    return out


def hf_beam_search(
    model: Any,
    case: Case,
    eos: int = EOS_ID,
    allowed: Callable[[list[int]], list[int]] | None = None,
) -> Result:
    """transformers' beam search; `allowed` (the tokens allowed after a generated prefix) as its
    prefix_allowed_tokens_fn."""
    import transformers

    config = transformers.GenerationConfig(
        num_beams=case.width,
        num_return_sequences=case.num_return,
        do_sample=False,
        length_penalty=case.length_penalty,
        early_stopping=case.early_stopping,
        max_new_tokens=case.max_new_tokens,
        eos_token_id=[eos],
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    fn = None
    if allowed is not None:
        fn = lambda _, ids: allowed(ids[len(case.prompt) :].tolist())  # noqa: E731
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([case.prompt]), generation_config=config, prefix_allowed_tokens_fn=fn
        )
    results: Result = []
    for seq, score in zip(out.sequences, out.sequences_scores, strict=True):
        ids = seq[len(case.prompt) :].tolist()
        reason = "length"
        if eos in ids:
            ids, reason = ids[: ids.index(eos) + 1], "stop"
        results.append((ids, float(score), reason))
    return results


def make_runner(
    path: Path,
    num_blocks: int,
    num_cpu_blocks: int,
    grammar: Callable[[], GrammarCompiler] | None = None,
) -> ModelRunner:
    model = load_model(str(path), dtype=torch.float64)
    c = model.config
    geometry = CacheGeometry(
        c.num_hidden_layers, c.num_key_value_heads, c.head_dim, BLOCK_SIZE, torch.float64
    )
    cache = KVCache(geometry, num_blocks, num_cpu_blocks, "cpu")
    return ModelRunner(
        model,
        cache,
        create_backend("torch", cache, c.num_attention_heads, c.head_dim, "cpu"),
        grammar,
    )


def run_engine(
    runner: ModelRunner,
    cases: list[Case],
    *,
    mode: str = "recompute",
    on_step: Callable[[Scheduler], None] = lambda s: None,
    eos: int = EOS_ID,
) -> tuple[dict[Case, Result], Scheduler]:
    """Every case as one request of one scheduler, plans made a step ahead as the engine loop
    does (async scheduling); the scheduler's integrity is checked after every plan and every
    update."""
    cache = runner.cache
    config = SchedulerConfig(
        max_num_seqs=64,
        max_num_batched_tokens=512,
        max_model_len=runner.model.config.max_model_len,
        preemption_mode=mode,  # type: ignore[arg-type]
        eos_token_ids=(eos,),
    )
    sched = Scheduler(config, BlockManager(cache.num_gpu_blocks, cache.num_cpu_blocks, BLOCK_SIZE))
    ids = {f"r{i}": case for i, case in enumerate(cases)}
    for req_id, case in ids.items():
        sched.add_request(Request(req_id, list(case.prompt), case.sampling()))
    got: dict[Case, Result] = {case: [] for case in cases}
    in_flight: deque[Any] = deque()

    def send() -> bool:
        plan = sched.schedule()
        sched.check_integrity()
        if plan.is_empty:
            return False
        in_flight.append((plan, runner.execute(plan)))
        return True

    while sched.has_unfinished_requests() or in_flight:
        if not in_flight:
            assert send(), "unfinished requests, and nothing to schedule"
        if len(in_flight) == 1:
            send()
        plan, result = in_flight.popleft()
        for d in sched.update(plan, result):
            assert d.finished and d.sequence_score is not None
            got[ids[d.parent_id or d.req_id]].append(
                (d.new_token_ids, d.sequence_score, d.finish_reason or "")
            )
        sched.check_integrity()
        on_step(sched)
    runner.reset()
    bm = sched.block_manager
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks, "blocks left in use"
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks, "swap blocks left in use"
    return got, sched


def assert_same(got: Result, want: Result, case: Case) -> None:
    assert [g[0] for g in got] == [w[0] for w in want], case
    assert [g[2] for g in got] == [w[2] for w in want], case
    for (_, score, _), (_, ref, _) in zip(got, want, strict=True):
        assert abs(score - ref) < SCORE_TOLERANCE, (case, score, ref)


def test_the_cases_cover_what_they_claim(expected: dict[Case, Result]) -> None:
    assert len(CASES) >= 24
    assert {c.width for c in CASES} == {2, 4, 6}
    assert {c.length_penalty for c in CASES} == {0.5, 1.0, 2.0}
    assert {str(c.early_stopping) for c in CASES} == {"False", "True", "never"}
    assert any(c.num_return < c.width for c in CASES)
    assert min(len(c.prompt) for c in CASES) == 1 and max(len(c.prompt) for c in CASES) == 200
    # Hypotheses finish by EOS at several lengths, and by length.
    eos_lengths = {len(ids) for r in expected.values() for ids, _, why in r if why == "stop"}
    assert len(eos_lengths) >= 3
    assert any(why == "length" for r in expected.values() for _, _, why in r)


@pytest.mark.parametrize("raised", [True, False], ids=["eos-raised", "plain"])
def test_equal_to_transformers(
    raised: bool, checkpoints: dict[bool, Path], expected: dict[Case, Result]
) -> None:
    cases = [c for c in CASES if c.eos_raised == raised]
    refs: list[int] = []
    runner = make_runner(checkpoints[raised], 512, 0)
    got, sched = run_engine(
        runner, cases, on_step=lambda s: refs.append(s.block_manager.num_gpu_block_refs)
    )
    for case in cases:
        assert_same(got[case], expected[case], case)
    stats = sched.stats()
    # Beams shared blocks (more references than blocks), and wrote into shared ones by copy.
    assert stats.num_gpu_block_refs == 0 and max(refs) > stats.peak_used_gpu_blocks
    assert stats.num_copied_blocks > 0


@pytest.mark.parametrize("raised", [True, False], ids=["eos-raised", "plain"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_equal_under_preemption(
    mode: str, raised: bool, checkpoints: dict[bool, Path], expected: dict[Case, Result]
) -> None:
    cases = [c for c in CASES if c.eos_raised == raised]
    biggest = max(
        BeamGroup.start(
            Request("x", list(c.prompt), c.sampling()), (EOS_ID,), 2048
        ).worst_case_blocks(BLOCK_SIZE)
        for c in cases
    )
    runner = make_runner(checkpoints[raised], biggest + 4, 256)
    got, sched = run_engine(runner, cases, mode=mode)
    for case in cases:
        assert_same(got[case], expected[case], case)
    stats = sched.stats()
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0


def test_a_group_swapped_out_keeps_its_blocks_shared() -> None:
    """Swapping a group moves each shared block once, and it comes back shared."""
    bm = BlockManager(64, 64, 4)
    beams = ["g#b0", "g#b1", "g#b2"]
    # Blocks 0-1 shared by the three beams, each with its own last block.
    bm.allocate_slots("g#b0", 8)
    bm.fork("g#b0", "g#b1")
    bm.fork("g#b0", "g#b2")
    for beam in beams:
        assert bm.reserve_slots(beam, 8, 10) is not None
    moves = bm.swap_out(beams)
    assert moves is not None and len(moves) == 2 + 3
    assert bm.cpu.refcounts[bm.get_cpu_block_ids("g#b1")[0]] == 3
    bm.check_integrity()
    assert bm.can_swap_in(beams, 10)
    moves = bm.swap_in(beams)
    assert moves is not None and len(moves) == 5
    tables = [bm.get_block_ids(b) for b in beams]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    bm.check_integrity()


def test_reassign_moves_tables_and_frees_unselected_beams() -> None:
    bm = BlockManager(16, 0, 4)
    bm.allocate_slots("g#b0", 6)
    bm.fork("g#b0", "g#b1")
    assert bm.reserve_slots("g#b1", 6, 7) is not None  # b1's last block is its own copy
    b0, b1 = bm.get_block_ids("g#b0"), bm.get_block_ids("g#b1")
    bm.reassign({"g#b0": "g#b1", "g#b1": "g#b1"})  # both next beams extend b1
    assert bm.get_block_ids("g#b0") == bm.get_block_ids("g#b1") == b1
    assert b0[1] in bm.free_gpu_block_ids()  # b0's own last block is free again
    assert bm.gpu.refcounts[b1[1]] == 2
    bm.check_integrity()


def test_beam_search_admission() -> None:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_model_len=256, eos_token_ids=(2,)),
        BlockManager(20, 0, 16),
    )
    wide = SamplingParams(max_tokens=8, beam_width=6, temperature=0.0)
    with pytest.raises(InvalidRequestError, match="beam_width = 6 exceeds max_num_seqs 4"):
        sched.add_request(Request("a", [5] * 10, wide))
    long = SamplingParams(max_tokens=200, beam_width=4)
    with pytest.raises(InvalidRequestError, match="beam search of width 4 can hold"):
        sched.add_request(Request("b", [5] * 40, long))
    # A group waiting for its first step holds its width in seats already.
    sched.add_request(Request("c", [5] * 10, SamplingParams(max_tokens=4, beam_width=3)))
    sched.add_request(Request("d", [6] * 10, SamplingParams(max_tokens=4, temperature=0.0)))
    sched.add_request(Request("e", [7] * 10, SamplingParams(max_tokens=4, temperature=0.0)))
    plan = sched.schedule()
    assert list(plan.num_scheduled_tokens) == ["c#b0", "d"]
    for name in ("top_k", "logprobs", "stop", "presence_penalty"):
        value: Any = {"top_k": 5, "logprobs": 1, "stop": ("x",), "presence_penalty": 0.5}[name]
        with pytest.raises(InvalidRequestError, match=f"takes no {name}"):
            SamplingParams(beam_width=2, **{name: value})
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(beam_width=2, temperature=0.7)
    with pytest.raises(InvalidRequestError, match="at most beam_width"):
        SamplingParams(beam_width=2, n=3)
    narrow = Scheduler(
        SchedulerConfig(max_num_batched_tokens=4, max_model_len=256), BlockManager(20, 0, 16)
    )
    with pytest.raises(InvalidRequestError, match="exceeds max_num_batched_tokens 4"):
        narrow.add_request(Request("f", [5] * 10, SamplingParams(max_tokens=4, beam_width=6)))


def test_a_swapped_group_counts_exactly_what_it_needs_to_come_back() -> None:
    """Two beams sharing a partly filled block: swapped in, one copies it and the other writes
    in place, so one block beyond the group's own is needed, not one per beam."""
    bm = BlockManager(5, 8, 4)
    bm.allocate_slots("g#b0", 6)  # 2 blocks, the second partly filled
    bm.fork("g#b0", "g#b1")
    assert bm.swap_out(["g#b0", "g#b1"]) is not None
    ranges = [("g#b0", 6, 7), ("g#b1", 6, 7)]
    assert bm.num_blocks_to_reserve(ranges) == 1
    assert bm.can_swap_in(["g#b0", "g#b1"], extra_blocks=1)
    bm.gpu.allocate(2)  # 3 free: 2 swapped blocks + 1 copy still fit
    assert bm.can_swap_in(["g#b0", "g#b1"], extra_blocks=bm.num_blocks_to_reserve(ranges))
    assert bm.swap_in(["g#b0", "g#b1"]) is not None
    assert all(bm.reserve_slots(b, 6, 7) is not None for b in ("g#b0", "g#b1"))
    assert bm.num_free_gpu_blocks == 0


def test_a_lost_worker_moves_its_beam_groups(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    import transformers

    rng = random.Random(5)
    cases = [
        Case(4, 2, 1.0, False, 150, tuple(rng.randrange(3, 512) for _ in range(30)), False)
        for _ in range(6)
    ]
    model = transformers.AutoModelForCausalLM.from_pretrained(micro_llama, dtype=torch.float64)
    want = [hf_beam_search(model, c) for c in cases]
    stack = start_stack(
        spawn,
        micro_llama,
        dtype="float64",
        num_workers=2,
        cp_args=("--worker-failover-timeout", "1"),
    )

    def run(case: Case) -> Result:
        req = request(
            list(case.prompt),
            max_tokens=case.max_new_tokens,
            temperature=0.0,
            n=case.num_return,
            beam_width=case.width,
            length_penalty=case.length_penalty,
            early_stopping=common_pb2.EARLY_STOPPING_FALSE,
            output_kind=pb.OUTPUT_KIND_FINAL_ONLY,
        )
        chunks = sorted(stack.stub.Generate(req, timeout=300), key=lambda c: c.index)
        return [(list(c.token_ids), c.sequence_score, c.finish_reason) for c in chunks]

    with ThreadPoolExecutor(len(cases)) as pool:
        futures = [pool.submit(run, c) for c in cases]
        deadline = time.monotonic() + 60
        while True:
            workers = stack.stats().workers
            if min(w.num_steps for w in workers) >= 20:
                break
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert workers[1].num_running > 0, "the worker to kill had finished already"
        lost = stack.workers[1]
        lost.proc.kill()
        lost.proc.wait()
        outs = [f.result(timeout=120) for f in futures]

    for case, got, ref in zip(cases, outs, want, strict=True):
        assert_same(got, ref, case)


SMOLLM2_EOS = 2  # <|im_end|>
CONSTRAINED = [  # (question, width, n, length_penalty, early_stopping, max_new_tokens, constraint)
    (
        "Describe a cat as JSON.",
        3, 2, 1.0, True, 40,
        StructuredOutput(
            "json_schema",
            json.dumps(
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 12},
                        "age": {"type": "integer", "minimum": 0, "maximum": 30},
                    },
                    "required": ["name", "age"],
                }
            ),
        ),
    ),
    ("Is the sky blue?", 2, 2, 1.0, True, 8, StructuredOutput.choices(["yes", "no", "maybe"])),
    (
        "Give a phone number.",
        4, 3, 0.5, False, 16,
        StructuredOutput("regex", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ),
]  # fmt: skip


def test_constrained_beams_equal_transformers() -> None:
    """Each beam holds its own matcher, forked with the beam; masks apply to the log-softmax,
    as transformers' prefix_allowed_tokens_fn does (SmolLM2, float64)."""
    import transformers

    path = ensure_default_model()
    tokenizer = vocab_tokenizer(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    vocab = model.config.vocab_size
    compiler = GrammarCompiler(tokenizer, vocab, (SMOLLM2_EOS,))
    cases = []
    for question, width, n, penalty, early, max_new, constraint in CONSTRAINED:
        prompt: Any = hf_tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(prompt, list):
            prompt = prompt["input_ids"]
        cases.append(Case(width, n, penalty, early, max_new, tuple(prompt), False, constraint))

    def allowed(constraint: StructuredOutput, generated: list[int]) -> list[int]:
        m = compiler.matcher(constraint)
        assert all(m.accept(t) for t in generated), generated  # no beam left the grammar
        return allowed_tokens([m], vocab)[0].nonzero().flatten().tolist()

    expected = {
        case: hf_beam_search(
            model,
            case,
            SMOLLM2_EOS,
            lambda ids, c=case.structured: allowed(c, ids),  # type: ignore[misc]
        )
        for case in cases
    }
    runner = make_runner(path, 256, 0, lambda: compiler)
    got, _ = run_engine(runner, cases, eos=SMOLLM2_EOS)
    for case in cases:
        assert_same(got[case], expected[case], case)
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _, _ in got[case]]
        assert all(why == "stop" for _, _, why in got[case]), texts
        if case.structured is not None and case.structured.kind == "choice":
            assert set(texts) <= {"yes", "no", "maybe"}, texts
