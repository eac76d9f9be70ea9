"""Structured output's cost: W64 on the default SmolLM2 model where every request carries one
of 8 JSON schemas, beside the same W64 unconstrained and beside vLLM's CPU build with the same
schemas, in one run; and the time to first token a schema adds the first time it is seen.

  * constrained: 64 chat prompts (rendered once, the same token ids for both systems), each
    with the JSON schema i mod 8 of `tests/json_schemas.BENCHMARK_SCHEMAS`, greedy, up to 512
    tokens: the output ends where the JSON does. Every output is validated.
  * unconstrained: the same prompts, greedy, ignore_eos, each as long as its constrained output
    was: the same tokens to generate, without the grammar.
  * vLLM: its offline `LLM.generate` with `StructuredOutputsParams(json=schema)` (xgrammar),
    greedy, up to 512 tokens; tokens/s of what it generated.
  * first-schema TTFT: one request alone with a 20-property schema never seen before (fresh
    property names), against the same request once the schema is cached; the difference,
    median over 5 schemas.

    python -m benchmarks.structured_output --vllm-venv /work/vllm-venv [--out PATH]
    python -m benchmarks.structured_output --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.baselines import VLLM_ENV, vllm_python
from benchmarks.common import (
    RESULTS_DIR,
    StackOptions,
    format_table,
    machine,
    start_stack,
    write_json,
)
from gpu_worker.config import auto_dtype
from pagedserve.cli.model_source import ensure_default_model
from tests.json_schemas import BENCHMARK_SCHEMAS, TWENTY_PROPERTY_SCHEMA, check_schema, schema_named

MAX_TOKENS = 512
TOPICS = [
    "an order", "an invoice", "a job posting", "a network device", "a flight",
    "a log entry", "an employee", "a customer record",
]  # fmt: skip

VLLM_STRUCTURED_SCRIPT = r"""
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True,
              max_model_len=2048, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"],
                             structured_outputs=StructuredOutputsParams(json=s))
              for s in spec["schemas"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up (and the first compiles)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    json.dump({"elapsed_s": elapsed, "texts": [o.outputs[0].text for o in outs],
               "lengths": [len(o.outputs[0].token_ids) for o in outs]}, open(sys.argv[2], "w"))
if __name__ == "__main__":
    main()
"""


def _prompts(model: Path, count: int) -> list[list[int]]:
    from control_plane.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    out = []
    for i in range(count):
        chat = tok.chat_prompt(
            [{"role": "user", "content": f"Give an example of {TOPICS[i % 8]} #{i} as JSON."}],
            True,
        )
        out.append(tok.encode(chat.text, False, chat.literal))
    return out


async def _run(
    address: str,
    prompts: list[list[int]],
    schemas: list[dict[str, Any]] | None,
    lengths: list[int] | None,
) -> tuple[float, list[str], list[int]]:
    import grpc

    from protos.v1 import common_pb2
    from protos.v1 import control_plane_pb2 as pb
    from protos.v1 import control_plane_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ControlPlaneStub(channel)

        async def one(i: int) -> tuple[str, int]:
            sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
            if schemas is not None:
                sp.structured_output.json_schema = json.dumps(schemas[i])
            if lengths is not None:
                sp.max_tokens, sp.ignore_eos = lengths[i], True
            req = pb.GenerateRequest(sampling=sp, output_kind=pb.OUTPUT_KIND_FINAL_ONLY)
            req.token_ids.ids.extend(prompts[i])
            text, n = "", 0
            async for msg in stub.Generate(req, timeout=3600):
                text += msg.text
                n = msg.completion_tokens
            return text, n

        await one(0)  # warm: connections, the first step, schema 0 compiled
        start = time.perf_counter()
        outs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return time.perf_counter() - start, [t for t, _ in outs], [n for _, n in outs]


async def _ttft(address: str, prompt: list[int], schema: dict[str, Any]) -> float:
    import grpc

    from protos.v1 import common_pb2
    from protos.v1 import control_plane_pb2 as pb
    from protos.v1 import control_plane_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ControlPlaneStub(channel)
        sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=4)
        sp.structured_output.json_schema = json.dumps(schema)
        req = pb.GenerateRequest(sampling=sp)
        req.token_ids.ids.extend(prompt)
        start = time.perf_counter()
        async for _ in stub.Generate(req, timeout=600):
            return time.perf_counter() - start
    raise RuntimeError("no response")


def _fresh_schema(k: int) -> dict[str, Any]:
    """The 20-property schema with property names no other request used."""
    schema = json.loads(json.dumps(TWENTY_PROPERTY_SCHEMA))
    schema["properties"] = {f"{name}_{k}": v for name, v in schema["properties"].items()}
    schema["required"] = [f"{name}_{k}" for name in schema.get("required", [])]
    return schema


def first_schema_ttft(address: str, prompt: list[int], rounds: int = 5) -> dict[str, float]:
    added = []
    for k in range(rounds):
        schema = _fresh_schema(int(time.time() * 1000) % 100000 * 10 + k)
        cold = asyncio.run(_ttft(address, prompt, schema))
        warm = statistics.median(asyncio.run(_ttft(address, prompt, schema)) for _ in range(3))
        added.append(cold - warm)
    return {"added_ms_median": statistics.median(added) * 1e3, "added_ms_max": max(added) * 1e3}


def vllm_structured(
    model: Path, venv: Path | None, prompts: list[list[int]], schemas: list[dict[str, Any]],
    dtype: str,
) -> dict[str, Any]:  # fmt: skip
    py = vllm_python(venv)
    if py is None:
        return {"skipped": f"no working vllm in {venv}"}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        spec, out, script = Path(tmp) / "spec.json", Path(tmp) / "out.json", Path(tmp) / "run.py"
        script.write_text(VLLM_STRUCTURED_SCRIPT)
        spec.write_text(
            json.dumps(
                {
                    "model": str(model),
                    "prompts": prompts,
                    "schemas": schemas,
                    "max_tokens": MAX_TOKENS,
                    "dtype": dtype,
                }
            )
        )
        env = {**os.environ, **VLLM_ENV}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(
            [str(py), str(script), str(spec), str(out)],
            capture_output=True, text=True, env=env, timeout=3600, cwd=tmp,
        )  # fmt: skip
        if proc.returncode != 0 or not out.exists():
            return {"skipped": f"vLLM failed: {(proc.stderr or proc.stdout)[-600:]}"}
        data = json.loads(out.read_text())
    valid = sum(check_schema(s, t) for s, t in zip(schemas, data["texts"], strict=True))
    tokens = sum(data["lengths"])
    return {
        "elapsed_s": data["elapsed_s"],
        "output_tokens": tokens,
        "tokens_per_s": tokens / data["elapsed_s"],
        "valid": valid,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--vllm-venv", type=Path, default=None)
    ap.add_argument("--dtype", default=auto_dtype("cpu"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="8 requests, no vLLM, 1 TTFT round")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "structured_output.json")
    a = ap.parse_args(argv)
    n = 8 if a.quick else a.requests
    model = ensure_default_model()
    prompts = _prompts(model, n)
    schemas = [schema_named(BENCHMARK_SCHEMAS[i % 8]) for i in range(n)]
    opts = StackOptions(dtype=a.dtype, kv_tokens=131072)
    with start_stack(model, opts) as stack:
        c_s, texts, lengths = asyncio.run(_run(stack.address, prompts, schemas, None))
        u_s, _, u_lengths = asyncio.run(_run(stack.address, prompts, None, lengths))
        ttft = first_schema_ttft(stack.address, prompts[0], 1 if a.quick else 5)
    valid = sum(check_schema(s, t) for s, t in zip(schemas, texts, strict=True))
    constrained = {"elapsed_s": c_s, "output_tokens": sum(lengths), "valid": valid}
    constrained["tokens_per_s"] = sum(lengths) / c_s
    unconstrained = {"elapsed_s": u_s, "output_tokens": sum(u_lengths)}
    unconstrained["tokens_per_s"] = sum(u_lengths) / u_s
    vllm = (
        {"skipped": "--quick"}
        if a.quick
        else vllm_structured(model, a.vllm_venv, prompts, schemas, a.dtype)
    )
    rows = [
        ["pagedserve, JSON schema", f"{constrained['tokens_per_s']:.0f}", f"{valid}/{n}"],
        ["pagedserve, unconstrained", f"{unconstrained['tokens_per_s']:.0f}", "-"],
    ]
    if "tokens_per_s" in vllm:
        rows.append(
            ["vLLM CPU, JSON schema", f"{vllm['tokens_per_s']:.0f}", f"{vllm['valid']}/{n}"]
        )
    print(f"W{n} on SmolLM2-135M-Instruct, {a.dtype}, 8 schemas, greedy, up to {MAX_TOKENS} tokens")
    print(format_table(["system", "output tok/s", "valid JSON"], rows))
    ratios = {
        "constrained_vs_unconstrained": constrained["tokens_per_s"] / unconstrained["tokens_per_s"]
    }
    if "tokens_per_s" in vllm:
        ratios["constrained_vs_vllm_constrained"] = constrained["tokens_per_s"] / float(
            vllm["tokens_per_s"]
        )
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    print(f"first request of an uncached 20-property schema adds {ttft['added_ms_median']:.1f} ms "
          f"of TTFT (median of rounds; max {ttft['added_ms_max']:.1f} ms)")  # fmt: skip
    write_json(
        a.out,
        {
            "benchmark": "structured_output",
            "machine": machine(),
            "dtype": a.dtype,
            "requests": n,
            "constrained": constrained,
            "unconstrained": unconstrained,
            "vllm_constrained": vllm,
            "ratios": ratios,
            "first_schema_ttft": ttft,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
