"""The simulator: its cost model and model shapes, its workloads, the event loop over the real
scheduler (every request ends with the tokens its workload gave it; preemption, swap, prefix
sharing and routing behave as the policies say), the Orca baselines, the profile fit, the CLI,
and a quick calibration against a real worker process."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedserve.plan import StepShape
from simulator.calibrate import fit_profile
from simulator.cluster import Simulation, next_pow2
from simulator.config import SimConfig
from simulator.cost import CostModel, DeviceProfile, ReplayedCost, resolve_profile
from simulator.hardware import MODELS, ModelShape, resolve_gpu, resolve_model
from simulator.report import HEADERS, format_table, summarize, sustained_rate, table_row
from simulator.workload import LENGTHS, SimRequest, Workload, WorkloadSpec, trace_requests

REPO = Path(__file__).resolve().parent.parent


def _sim(
    requests: list[SimRequest] | None = None,
    spec: WorkloadSpec | None = None,
    device: str = "A100-80GB",
    model: str = "llama-3-8b",
    **config: object,
) -> dict[str, Any]:
    workload = Workload(spec or WorkloadSpec(num_requests=0, max_model_len=2048))
    config.setdefault("max_model_len", workload.spec.max_model_len)
    cost = CostModel(DeviceProfile.for_gpu(device), resolve_model(model))
    sim = Simulation(SimConfig(**config), cost, workload)  # type: ignore[arg-type]
    result = sim.run(requests)
    s = summarize(result)
    s["_records"] = result.records
    return s


def _fixed_requests(n: int, prompt: int, output: int, at: float = 0.0) -> list[SimRequest]:
    return [SimRequest(f"r{i}", at, [3 + (i * 7 + j) % 1000 for j in range(prompt)], output)
            for i in range(n)]  # fmt: skip


# -- model shapes and the cost model -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "billions"),
    [("llama-3-8b", 8.03), ("llama-3-70b", 70.6), ("qwen3-32b", 32.8), ("opt-13b", 12.85)],
)
def test_named_models_have_their_published_sizes(name: str, billions: float) -> None:
    assert MODELS[name].num_params / 1e9 == pytest.approx(billions, rel=0.02)


def test_a_config_json_gives_the_shape(tmp_path: Path) -> None:
    cfg = {
        "model_type": "qwen3", "num_hidden_layers": 4, "hidden_size": 256,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = resolve_model(str(tmp_path))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (4, 2, 64)
    assert shape.kv_bytes_per_token == 2 * 4 * 2 * 64 * 2
    opt = {"model_type": "opt", "num_hidden_layers": 2, "hidden_size": 128,
           "num_attention_heads": 4, "ffn_dim": 512, "vocab_size": 100}  # fmt: skip
    (tmp_path / "opt.json").write_text(json.dumps(opt))
    o = ModelShape.from_hf_config(tmp_path / "opt.json")
    assert not o.gated_mlp and o.num_kv_heads == 4 and o.max_model_len == 2048
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="unknown GPU"):
        resolve_gpu("Z80")


def test_decode_is_bound_by_the_weights_and_prefill_by_compute() -> None:
    m = MODELS["llama-3-8b"]
    p = DeviceProfile.for_gpu("H100")
    cost = CostModel(p, m)
    one = cost.step_time(StepShape(rows=1, tokens=1, sampled_rows=1, context_tokens=100))
    weights_s = m.weight_bytes / (p.bandwidth * p.bandwidth_efficiency)
    assert one == pytest.approx(p.overhead_s + p.per_row_s + weights_s, rel=0.02)
    # A 4k-token prefill is compute-bound: time grows with tokens, far above the weight time.
    pre = cost.step_time(
        StepShape(rows=1, tokens=4096, sampled_rows=1, attention_pairs=4096**2 // 2)
    )
    assert pre > 5 * one
    # H200 has the H100's compute and more bandwidth: decode is faster, prefill is not.
    h200 = CostModel(DeviceProfile.for_gpu("H200"), m)
    assert h200.step_time(StepShape(rows=1, tokens=1, sampled_rows=1)) < one
    pre200 = h200.step_time(
        StepShape(rows=1, tokens=4096, sampled_rows=1, attention_pairs=4096**2 // 2)
    )
    assert pre200 == pytest.approx(pre, rel=0.05)
    # A plan without tokens runs no forward pass.
    assert cost.step_time(StepShape()) == 0.0
    assert cost.step_time(StepShape(swapped_blocks=10)) > 0.0


def test_tensor_parallelism_splits_weights_and_adds_all_reduces() -> None:
    m = MODELS["llama-3-70b"]
    with pytest.raises(ValueError, match="does not fit"):
        CostModel(DeviceProfile.for_gpu("H100"), m).num_gpu_blocks()
    tp4 = CostModel(DeviceProfile.for_gpu("H100"), m, tp=4)
    tp8 = CostModel(DeviceProfile.for_gpu("H100"), m, tp=8)
    assert tp8.num_gpu_blocks() > tp4.num_gpu_blocks() > 0
    shape = StepShape(rows=64, tokens=64, sampled_rows=64, context_tokens=64 * 1000)
    assert tp8.step_time(shape) < tp4.step_time(shape)
    no_link = CostModel(DeviceProfile.for_gpu("H100", link_bandwidth=1e9), m, tp=8)
    assert no_link.step_time(shape) > tp8.step_time(shape)


def test_the_kv_pool_is_what_memory_leaves_after_weights_and_activations() -> None:
    m = MODELS["llama-3-8b"]
    cost = CostModel(DeviceProfile.for_gpu("H100"), m)
    blocks = cost.num_gpu_blocks(0.9, 8192, 256)
    left = 0.9 * 80 * (1 << 30) - m.weight_bytes - cost.activation_bytes(8192, 256)
    assert blocks == math.floor(left / (16 * m.kv_bytes_per_token))
    # Llama-3-8B's KV is 128 KiB a token: about 60 GiB of 80 hold some 460k tokens.
    assert 400_000 < blocks * 16 < 500_000
    assert cost.num_gpu_blocks(0.5) < blocks


def test_profiles_resolve_by_name_or_path(tmp_path: Path) -> None:
    p = DeviceProfile.for_gpu("L4", flops_efficiency=0.5)
    assert p.flops_efficiency == 0.5 and p.memory_bytes == 24 * (1 << 30)
    p.save(tmp_path / "l4.json")
    assert resolve_profile(str(tmp_path / "l4.json")) == p
    assert resolve_profile("cpu").fitted["model"]  # the shipped, fitted profile
    with pytest.raises(ValueError, match="calibrate"):
        resolve_profile(str(tmp_path / "missing.json"))


def test_the_fit_recovers_a_known_profile() -> None:
    m = MODELS["llama-3-8b"]
    truth = DeviceProfile("x", 2e13, 5e11, 1 << 36, 1e12, 1e12, 1.0, 1.0, 0.3, 0.004, 3e-5, 2e-6)
    cost = CostModel(truth, m)
    shapes = [StepShape(b, b, b, b * c, b * c) for b in (1, 4, 16, 64, 256) for c in (64, 1024)]
    shapes += [StepShape(1, n, 1, n * (n + 1) // 2, 0) for n in (128, 512, 2048, 8192)]
    fitted, err = fit_profile("x", m, [(s, cost.step_time(s)) for s in shapes], 1 << 36)
    assert err < 0.03
    refit = CostModel(fitted, m)
    for s in shapes:
        assert refit.step_time(s) == pytest.approx(cost.step_time(s), rel=0.06)


# -- workloads ---------------------------------------------------------------------------------


def test_sharegpt_and_alpaca_lengths_keep_the_papers_ratios() -> None:
    means = {}
    for name in ("sharegpt", "alpaca"):
        wl = Workload(WorkloadSpec(lengths=name, num_requests=20000, max_model_len=8192, seed=1))
        reqs = list(wl.requests())
        means[name] = (
            statistics.fmean(len(r.prompt_ids) for r in reqs),
            statistics.fmean(r.output_len for r in reqs),
        )
        pm, _, om, _ = LENGTHS[name]
        assert means[name][0] == pytest.approx(pm, rel=0.06)
        assert means[name][1] == pytest.approx(om, rel=0.06)
    assert means["sharegpt"][0] / means["alpaca"][0] == pytest.approx(8.4, rel=0.1)
    assert means["sharegpt"][1] / means["alpaca"][1] == pytest.approx(5.8, rel=0.1)


def test_arrivals_poisson_and_bursty() -> None:
    def gaps(**kw: object) -> list[float]:
        wl = Workload(WorkloadSpec(lengths="fixed", num_requests=5000, rate=10.0, **kw))  # type: ignore[arg-type]
        t = [r.arrival_s for r in wl.requests()]
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    g = gaps()
    assert statistics.fmean(g) == pytest.approx(0.1, rel=0.05)
    assert statistics.stdev(g) / statistics.fmean(g) == pytest.approx(1.0, rel=0.1)
    b = gaps(arrival="gamma", cv=3.0)
    assert statistics.fmean(b) == pytest.approx(0.1, rel=0.15)
    assert statistics.stdev(b) / statistics.fmean(b) > 2.4
    with pytest.raises(ValueError, match="exactly one"):
        WorkloadSpec()


def test_shared_prefixes_and_sessions() -> None:
    wl = Workload(WorkloadSpec(lengths="fixed", prompt_len=10, num_requests=50, num_prefixes=3,
                               prefix_len=32, turns=3, think_time_s=1.0))  # fmt: skip
    reqs = list(wl.requests())
    assert len({tuple(r.prompt_ids[:32]) for r in reqs}) == 3
    first = reqs[0]
    nxt = wl.next_turn(first, [5, 6, 2], now=10.0)
    assert nxt is not None and nxt.req_id.endswith("-t1") and nxt.arrival_s >= 10.0
    assert nxt.prompt_ids[: len(first.prompt_ids) + 3] == first.prompt_ids + [5, 6, 2]
    last = wl.next_turn(nxt, [7], now=20.0)
    assert last is not None and wl.next_turn(last, [8], now=30.0) is None


# -- the event loop ----------------------------------------------------------------------------


def test_every_request_ends_with_its_output_length() -> None:
    reqs = _fixed_requests(40, 100, 0)
    for i, r in enumerate(reqs):
        r.output_len = 1 + (i * 37) % 200
    s = _sim(reqs, num_gpu_blocks=4000)
    assert s["completed"] == 40 and s["num_preemptions"] == 0
    for rec in s["_records"]:  # type: ignore[attr-defined]
        assert rec.output_tokens == rec.req.output_len
        assert rec.arrival <= rec.scheduled <= rec.first_token <= rec.finish


def test_a_small_pool_preempts_and_every_request_still_finishes() -> None:
    reqs = _fixed_requests(64, 200, 200)
    roomy = _sim(reqs, num_gpu_blocks=4000)
    tight = _sim(_fixed_requests(64, 200, 200), num_gpu_blocks=300)
    assert roomy["num_preemptions"] == 0
    assert tight["num_preemptions"] > 0 and tight["completed"] == 64
    assert tight["output_throughput"] < roomy["output_throughput"]
    swap = _sim(_fixed_requests(64, 200, 200), num_gpu_blocks=300, preemption="swap")
    assert swap["num_preemptions_swap"] > 0 and swap["completed"] == 64


def test_async_scheduling_plans_ahead() -> None:
    a = _sim(_fixed_requests(8, 50, 50), num_gpu_blocks=1000)
    s = _sim(_fixed_requests(8, 50, 50), num_gpu_blocks=1000, async_scheduling=False)
    # The same tokens either way; with plans made ahead, a request ending by EOS has a step in
    # flight too many (a plan made before its last token was known).
    assert a["output_tokens"] == s["output_tokens"] == 400
    assert s["num_token_steps"] < a["num_token_steps"] <= s["num_token_steps"] + 2


def test_replayed_step_times_give_the_same_run() -> None:
    """ReplayedCost prices the k-th step with the k-th time given: a run's own step times,
    replayed, make the same steps, preemptions and latencies; past them, the roofline."""
    times: list[float] = []

    class Recording(CostModel):
        def step_time(self, s: StepShape) -> float:
            times.append(super().step_time(s))
            return times[-1]

    profile, model = DeviceProfile.for_gpu("A100-80GB"), resolve_model("llama-3-8b")
    spec = WorkloadSpec(num_requests=60, rate=30.0, max_model_len=2048, seed=5)
    cfg = SimConfig(max_model_len=2048, num_gpu_blocks=400)
    first = summarize(Simulation(cfg, Recording(profile, model), Workload(spec)).run())
    assert first["num_preemptions"] > 0 and len(times) == first["num_steps"]
    base = CostModel(profile, model)
    for given in (times, times[: len(times) // 2]):
        again = summarize(Simulation(cfg, ReplayedCost(base, given), Workload(spec)).run())
        for key in ("num_steps", "num_preemptions", "output_tokens", "ttft"):
            assert again[key] == first[key], key
    doubled = ReplayedCost(base, [2 * t for t in times])
    slower = summarize(Simulation(cfg, doubled, Workload(spec)).run())
    assert slower["duration_s"] > first["duration_s"]


def test_the_same_seed_gives_the_same_run() -> None:
    spec = WorkloadSpec(num_requests=200, rate=20.0, max_model_len=4096, seed=3)
    a = _sim(spec=spec, num_workers=2)
    b = _sim(spec=WorkloadSpec(num_requests=200, rate=20.0, max_model_len=4096, seed=3),
             num_workers=2)  # fmt: skip
    for key in ("num_steps", "output_tokens", "num_preemptions"):
        assert a[key] == b[key]
    assert a["ttft"] == b["ttft"]


def test_sessions_hit_the_prefix_cache() -> None:
    spec = WorkloadSpec(lengths="fixed", prompt_len=300, output_len=50, num_requests=20,
                        rate=5.0, turns=4, think_time_s=0.5, max_model_len=4096)  # fmt: skip
    s = _sim(spec=spec)
    assert s["completed"] == 80
    assert s["prefix_hit_rate"] > 0.4  # later turns find their history cached


def test_kv_aware_routing_finds_shared_prefixes() -> None:
    def run(routing: str) -> dict[str, Any]:
        spec = WorkloadSpec(
            lengths="fixed",
            prompt_len=64,
            output_len=32,
            num_requests=400,
            rate=40.0,
            num_prefixes=40,
            prefix_len=1024,
            max_model_len=2048,
        )
        # A worker holds about 15 of the 40 prefixes: only placement by prefix keeps them all.
        return _sim(spec=spec, num_workers=4, routing=routing, num_gpu_blocks=1200)

    kv, rr, ll = run("kv-aware"), run("round-robin"), run("least-loaded")
    assert kv["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.1
    assert kv["prefix_hit_rate"] > ll["prefix_hit_rate"]
    assert kv["routed_with_prefix_hit"] > 150 and rr["routed_with_prefix_hit"] == 0
    assert kv["prefix_index"]["lookups_per_s"] > 0  # type: ignore[index]
    assert kv["prefix_index"]["peak_entries"] > 40 * 64  # type: ignore[index]
    assert kv["ttft"]["p50_ms"] < rr["ttft"]["p50_ms"]  # type: ignore[index]


def test_orca_baselines_batch_fewer_requests() -> None:
    assert [next_pow2(n) for n in (1, 2, 3, 25, 64, 65)] == [1, 2, 4, 32, 64, 128]
    spec = dict(lengths="sharegpt", num_requests=300, rate=50.0, max_model_len=2048, seed=2)
    batch = {}
    for alloc in ("paged", "orca-oracle", "orca-pow2", "orca-max"):
        s = _sim(spec=WorkloadSpec(**spec), model="opt-13b", device="A100-40GB",  # type: ignore[arg-type]
                 allocation=alloc, enable_prefix_caching=False)  # fmt: skip
        assert s["completed"] == 300 and s["num_preemptions"] == 0 or alloc == "paged"
        batch[alloc] = s["mean_batch_size"]
    assert batch["paged"] > batch["orca-oracle"] > batch["orca-pow2"] > batch["orca-max"]


def test_trace_replay_from_a_bench_serve_report(tmp_path: Path) -> None:
    report = {"ignore_eos": True, "runs": [{"requests": [
        {"arrival_s": 0.5, "prompt_tokens": 20, "output_tokens": 5, "ok": True},
        {"arrival_s": 0.0, "prompt_tokens": 30, "output_tokens": 7, "ok": True},
        {"arrival_s": 0.1, "prompt_tokens": 30, "output_tokens": 7, "ok": False},
    ]}]}  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(report))
    reqs = trace_requests(path)
    assert [(r.arrival_s, len(r.prompt_ids), r.output_len) for r in reqs] == [
        (0.0, 30, 7), (0.5, 20, 5)
    ]  # fmt: skip
    assert all(r.ignore_eos for r in reqs)
    s = _sim(reqs, num_gpu_blocks=100)
    assert s["output_tokens"] == 12
    report["runs"][0]["requests"][0].pop("arrival_s")  # type: ignore[index]
    path.write_text(json.dumps(report))
    with pytest.raises(ValueError, match="arrival_s"):
        trace_requests(path)


def test_sustained_rate_is_the_last_rate_under_the_threshold() -> None:
    runs = [{"rate": r, "summary": {"normalized_latency_s_per_token": v}}
            for r, v in ((1, 0.1), (2, 0.2), (3, 0.9), (4, 0.3))]  # fmt: skip
    assert sustained_rate(runs, 0.5) == 2.0
    assert sustained_rate(runs, 0.05) is None


def _uniform(rate: float, n: int, output: int) -> list[SimRequest]:
    return [SimRequest(f"r{i}", i / rate, [3 + (i * 7 + j) % 1000 for j in range(64)], output)
            for i in range(n)]  # fmt: skip


def test_the_tables_throughput_leaves_the_drain_out() -> None:
    """Under capacity the table's req/s is the offered rate, however long the drain after the
    last arrival; over it, the capacity. The whole-run figure (bench serve's) reads below the
    rate in both."""
    # 4 req/s for 20 s, each 1000 tokens (~8 s): the drain is long against the arrivals.
    under = _sim(_uniform(4.0, 80, 1000), device="H100", max_model_len=2048)
    assert under["steady_request_throughput"] == pytest.approx(4.0, rel=0.1)
    assert under["request_throughput"] < 0.8 * 4.0
    row = table_row({"allocation": "paged", "routing": "kv-aware", "rate": 4.0, "summary": under})
    assert row[HEADERS.index("req/s")] == f"{under['steady_request_throughput']:.2f}"
    # Two sequences at a time, 200 tokens each: about 5 req/s at most, against 20 offered.
    over = _sim(_uniform(20.0, 200, 200), device="H100", max_model_len=2048, max_num_seqs=2)
    capacity = over["steady_request_throughput"]
    assert 0.0 < capacity < 0.5 * 20.0
    assert over["steady_output_throughput"] == pytest.approx(200 * capacity)
    # A burst has no arrival period: the whole run is its drain.
    burst = _sim(_fixed_requests(8, 16, 16), device="H100", max_model_len=2048)
    assert burst["steady_window_s"] is None
    assert burst["steady_request_throughput"] == burst["request_throughput"]
    assert "drain" in format_table([{"allocation": "paged", "routing": "kv-aware", "rate": 4.0,
                                     "summary": under}])  # fmt: skip


# -- the command line ----------------------------------------------------------------------------


def test_simulate_command_writes_a_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    cmd = [
        sys.executable, "-m", "pagedserve.cli", "simulate", "--device", "H100",
        "--model", "llama-3-8b", "--workers", "2", "--rate", "2,8", "--num-requests", "60",
        "--allocation", "paged,orca-max", "--latency-threshold", "0.5",
        "--slo-ttft-p99-ms", "1000", "--out", str(out), "--plot", str(tmp_path / "png"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "out tok/s" in done.stdout and "sustained under 0.5" in done.stdout
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 4 and report["device"] == "H100"
    assert {r["allocation"] for r in report["runs"]} == {"paged", "orca-max"}
    assert all(r["summary"]["completed"] == 60 for r in report["runs"])
    assert all(isinstance(r["summary"]["slo_met"], bool) for r in report["runs"])
    assert (tmp_path / "png" / "latency_vs_rate.png").stat().st_size > 1000
    assert (tmp_path / "png" / "kv_utilization.png").stat().st_size > 1000
    bad = subprocess.run(
        [*cmd[:4], "--allocation", "buddy"], capture_output=True, text=True, cwd=REPO
    )
    assert bad.returncode == 2 and "choose from" in bad.stderr
    nothing = subprocess.run([*cmd[:4]], capture_output=True, text=True, cwd=REPO)
    assert nothing.returncode != 0 and "--duration or --num-requests" in nothing.stderr


# The sweep's steps take what a busy machine gives them: bounded only against a hang.
@pytest.mark.timeout(1800)
def test_calibration_fits_a_profile_from_a_real_worker(tmp_path: Path) -> None:
    """The sweep, the step trace and the fit, end to end. How well the profile predicts the
    steps is the machine's business (a busy one makes step times noise): the benchmark prints
    it and saves it with the profile; here it is only the error of the profile written."""
    profile = tmp_path / "cpu.json"
    cmd = [
        sys.executable, "-m", "benchmarks.calibrate_simulator", "--preset", "tiny",
        "--dtype", "float32", "--quick", "--decode-steps", "6", "--kv-tokens", "8192",
        "--profile-out", str(profile), "--out", str(tmp_path / "cal.json"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1700, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    p = DeviceProfile.load(profile)
    assert p.fitted["model"] == "tiny" and p.fitted["dtype"] == "float32"
    # The control plane's --step-trace: one line per step, its shape and its time.
    out = json.loads((tmp_path / "cal.json").read_text())
    samples = out["samples"]
    assert len(samples) > 20 and all(s["seconds"] > 0 for s in samples)
    assert all(s["rows"] <= s["tokens"] and s["sampled_rows"] <= s["rows"] for s in samples)
    # The error saved is the profile's own over the steps it was fitted to.
    shape = ModelShape(**p.fitted["model_shape"])
    cost = CostModel(p, shape, 1, out["worker"]["block_size"])
    keys = list(StepShape.__dataclass_fields__)
    errors = [
        cost.step_time(StepShape(**{k: s[k] for k in keys}))
        / max(s["seconds"], s["worker_seconds"])
        - 1
        for s in samples
        if s["tokens"]
    ]
    assert p.fitted["steps"] == len(samples)
    assert p.fitted["median_relative_error"] == pytest.approx(
        statistics.median(abs(e) for e in errors), rel=1e-6
    )
    assert min(p.peak_flops, p.bandwidth, p.attention_efficiency) > 0
    assert min(p.overhead_s, p.per_row_s, p.per_token_s) >= 0
    # Each request reaches the worker whole once (no preemption in this sweep).
    new = [r for s in samples for r in s["new"]]
    assert len(new) == len(set(new)) > 20
    # A lone 512-token prompt (a prefill group); 8 prompts of 64 may pack into 512 tokens too.
    prefills = [s for s in samples if s["tokens"] == 512 and s["rows"] == 1]
    assert prefills and prefills[0]["attention_pairs"] == 512 * 513 // 2
    # Decode steps of a batch (however its requests arrived) carry every row's prompt: the
    # decode groups' prompts are 64 tokens, the prefill groups' 128 and more.
    decodes = [s for s in samples if s["rows"] == s["tokens"] > 1]
    assert decodes and all(s["context_tokens"] >= 64 * s["rows"] for s in decodes)
