"""How soon the gateway answers and serves again when its control plane dies and comes back.

A worker, a control plane and a gateway as real processes. Each round kills the control plane,
keeps asking the gateway for `--outage` seconds (each answer a 503; the time it takes is
`refusal`), starts a control plane again on the same port and measures from the moment it
serves until the gateway's /health answers 200 (`reconnect`) and a completion is served
(`served`). gRPC's default reconnect back-off answered 10.8 s late after a 17 s outage; the
gateway's capped back-off (gateway.upstream) reconnects within about a second on a quiet
machine. These are speeds: tests/test_gateway_resilience.py checks what holds on any machine.

    python -m benchmarks.gateway_reconnect                 # tiny, 3 rounds of 9 s outages
    python -m benchmarks.gateway_reconnect --rounds 5 --outage 17
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    RESULTS_DIR,
    Process,
    StackOptions,
    format_table,
    machine,
    model_dir,
    start_stack,
    write_json,
)
from pagedserve.ports import free_port


def timed(call: Any) -> tuple[Any, float]:
    start = time.monotonic()
    out = call()
    return out, time.monotonic() - start


def one_round(
    url: str, cp: Process, address: str, outage_s: float
) -> tuple[Process, dict[str, Any]]:
    """Kills `cp`, asks through the outage, starts a new one: the round's figures and it."""
    args = [str(x) for x in cp.proc.args][3:]  # type: ignore[union-attr]  # past `python -m ...`
    cp.proc.kill()
    cp.stop()
    killed = time.monotonic()
    refusals: list[float] = []
    while time.monotonic() - killed < outage_s:
        r, took = timed(lambda: httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}))
        if r.status_code != 503:
            raise RuntimeError(f"expected 503 while the control plane is down, got {r.text}")
        refusals.append(took)
        time.sleep(0.25)
    new = Process("control-plane", args, env={"OMP_NUM_THREADS": "1"})
    new.wait_serving(address)
    back = time.monotonic()
    while httpx.get(f"{url}/health", timeout=30).status_code != 200:
        time.sleep(0.05)
    reconnect_s = time.monotonic() - back
    body = {"prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    return new, {
        "outage_s": back - killed,
        "refusals": len(refusals),
        "refusal_p50_ms": statistics.median(refusals) * 1e3,
        "refusal_max_ms": max(refusals) * 1e3,
        "reconnect_s": reconnect_s,
        "served_s": time.monotonic() - back,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--outage", type=float, default=9.0, help="seconds asked through, each round")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "gateway_reconnect.json")
    a = p.parse_args(argv)

    rows: list[dict[str, Any]] = []
    with start_stack(model_dir(a.preset), StackOptions()) as stack:
        url = f"http://127.0.0.1:{free_port()}"
        port = url.rsplit(":", 1)[1]
        gateway = Process("gateway", ["gateway", "--port", port, "--control-plane", stack.address])
        stack.processes.append(gateway)
        gateway.wait_http(f"{url}/health")
        for i in range(a.rounds):
            cp = stack.processes[1]
            stack.processes[1], row = one_round(url, cp, stack.address, a.outage)
            rows.append(row)
            print(
                f"round {i + 1}/{a.rounds}: reconnected in {row['reconnect_s']:.2f} s", flush=True
            )
    headers = ["round", "outage s", "503s", "503 p50 ms", "503 max ms", "reconnect s", "served s"]
    table = [
        [i + 1, r["outage_s"], r["refusals"], r["refusal_p50_ms"], r["refusal_max_ms"],
         r["reconnect_s"], r["served_s"]]
        for i, r in enumerate(rows)
    ]  # fmt: skip
    print(format_table(headers, table))
    write_json(
        a.out,
        {
            "benchmark": "gateway_reconnect",
            "machine": machine(),
            "preset": a.preset,
            "rounds": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
