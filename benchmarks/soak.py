"""Soak: minutes of mixed traffic against `pagedserve up`, with a worker killed and Redis
restarted on the way, then every greedy answer checked against a replay.

One `up` (gateway, control plane, one worker; `up` restarts a worker that dies) on a Redis
server of the script's own, so that Redis can be killed and started again on its port.
`--concurrency` closed-loop clients send `/v1/completions` requests back to back until the
time is up, each request one of these kinds:

* `stream`, `whole`: greedy, streamed or not;
* `stop`: greedy, streamed, with stop strings;
* `logprobs`: greedy, streamed, with `logprobs: 2` (every chunk must carry them);
* `n2`: `n = 2` at temperature 0.8, streamed (both choices must finish);
* `abort`: streamed, the client gone before the first token;
* `disconnect`: streamed, the client gone after three chunks.

Prompts are token ids, half of them behind one of four shared 32-token prefixes (so the
prefix cache and its Redis index are in play). A third of the way in, the worker is killed
(SIGKILL): its requests wait for it and resume where they were (or are refused with 503
while no worker answers: the failover window, from the kill until `/health` is 200 again).
Two thirds of the way in, Redis is killed and started again a second later.

Afterwards: the queue drains and the KV pool empties; every greedy request that completed is
sent again alone (non-streamed) and must give the same text and token count: a token lost or
duplicated across the worker's death, a preemption or a stream shows up there. Reported: the
requests by kind and status, 5xx inside and outside the failover window, mismatches against
the replay, the RSS of the gateway and control plane (once a second; "flat" compares the last
quarter with the first after warm-up), and the drain.

    python -m benchmarks.soak --minutes 30
    python -m benchmarks.soak --minutes 1 --out /tmp/soak.json   # what `make test` runs

The worker runs float64 by default, so that a different batch cannot move a greedy token by
rounding and every mismatch is a real one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    RESULTS_DIR,
    Process,
    format_table,
    free_port,
    machine,
    model_dir,
    write_json,
)
from benchmarks.overload import child_pids, rss_drift, rss_mib, wait_drained

KINDS = {  # kind -> share of requests
    "stream": 0.25,
    "whole": 0.15,
    "stop": 0.1,
    "logprobs": 0.15,
    "n2": 0.15,
    "abort": 0.1,
    "disconnect": 0.1,
}
CHECKED = ("stream", "whole", "stop", "logprobs")  # greedy: replayed and compared
STOP_STRINGS = ["e", "\n"]
REPLAY_CONCURRENCY = 32  # replayed answers are checked one by one, but computed in batches


@dataclass
class Outcome:
    kind: str
    body: dict[str, Any]
    start: float
    end: float = 0.0
    status: int = 0
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    completion_tokens: int | None = None
    error: str = ""
    chunks_without_logprobs: int = 0

    @property
    def server_error(self) -> bool:
        return self.status >= 500


def body_for(
    rng: random.Random, kind: str, vocab: int, prefixes: list[list[int]]
) -> dict[str, Any]:
    suffix = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))]
    prompt = (rng.choice(prefixes) + suffix) if rng.random() < 0.5 else suffix
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": rng.randint(8, 48), "temperature": 0.0,
        "stream": kind != "whole",
    }  # fmt: skip
    if kind == "stop":
        body["stop"] = STOP_STRINGS
    elif kind == "logprobs":
        body["logprobs"] = 2
    elif kind == "n2":
        body |= {"n": 2, "temperature": 0.8, "seed": rng.randrange(1 << 30)}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body


async def send(client: httpx.AsyncClient, url: str, out: Outcome) -> Outcome:
    try:
        if not out.body["stream"]:
            r = await client.post(url + "/v1/completions", json=out.body)
            out.status = r.status_code
            if r.status_code == 200:
                data = r.json()
                for c in data["choices"]:
                    out.texts[c["index"]] = c["text"]
                    out.finish[c["index"]] = c["finish_reason"]
                out.completion_tokens = data["usage"]["completion_tokens"]
            else:
                out.error = r.text[:200]
            return out
        async with client.stream("POST", url + "/v1/completions", json=out.body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                out.error = r.text[:200]
                return out
            if out.kind == "abort":
                return out
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.status, out.error = 500, str(event["error"])[:200]
                    return out
                if event.get("usage") and not event["choices"]:
                    out.completion_tokens = event["usage"]["completion_tokens"]
                for c in event["choices"]:
                    i = c["index"]
                    out.texts[i] = out.texts.get(i, "") + c["text"]
                    if c.get("finish_reason"):
                        out.finish[i] = c["finish_reason"]
                    if out.kind == "logprobs" and c["text"] and not c.get("logprobs"):
                        out.chunks_without_logprobs += 1
                chunks += 1
                if out.kind == "disconnect" and chunks >= 3:
                    return out
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.end = time.monotonic()
    return out


@dataclass
class Faults:
    """When the worker was killed and answered again, and when Redis went down and came back."""

    worker_killed: float | None = None
    worker_back: float | None = None
    redis_killed: float | None = None
    redis_back: float | None = None

    def in_failover(self, o: Outcome, slack: float = 1.0) -> bool:
        if self.worker_killed is None:
            return False
        end = (self.worker_back or float("inf")) + slack
        return o.start <= end and o.end >= self.worker_killed


async def until_healthy(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    return False


async def soak(
    url: str,
    seconds: float,
    concurrency: int,
    vocab: int,
    seed: int,
    inject: Any,
    sample: Any,
) -> list[Outcome]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(4)]
    kinds, weights = list(KINDS), list(KINDS.values())
    outcomes: list[Outcome] = []
    start = time.monotonic()
    deadline = start + seconds
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)

    async def client_loop(client: httpx.AsyncClient, crng: random.Random) -> None:
        while time.monotonic() < deadline:
            kind = crng.choices(kinds, weights)[0]
            out = Outcome(kind, body_for(crng, kind, vocab, prefixes), time.monotonic())
            outcomes.append(await send(client, url, out))
            if out.status in (429, 503):  # as a client honouring Retry-After would
                await asyncio.sleep(0.5)

    async def sampler() -> None:
        while time.monotonic() < deadline:
            sample()
            await asyncio.sleep(1.0)

    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        loops = [client_loop(client, random.Random(rng.random())) for _ in range(concurrency)]
        await asyncio.gather(*loops, sampler(), inject(start, seconds))
    return outcomes


async def replay(url: str, outcomes: list[Outcome], concurrency: int) -> list[dict[str, Any]]:
    """Every completed greedy request again, alone and whole; the ones that differ."""
    todo = [
        o
        for o in outcomes
        if o.kind in CHECKED and o.status == 200 and not o.error and 0 in o.finish
    ]
    mismatches: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, o: Outcome) -> None:
        body = {k: v for k, v in o.body.items() if k not in ("stream", "stream_options")}
        async with sem:
            r = await client.post(url + "/v1/completions", json=body | {"stream": False})
        data = r.json()
        text, tokens = data["choices"][0]["text"], data["usage"]["completion_tokens"]
        if text != o.texts.get(0) or (o.completion_tokens not in (None, tokens)):
            mismatches.append({
                "kind": o.kind, "soak_text": o.texts.get(0), "replay_text": text,
                "soak_tokens": o.completion_tokens, "replay_tokens": tokens,
            })  # fmt: skip

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, o) for o in todo))
    return [{"replayed": len(todo)}, *mismatches]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--preset", default="tiny", help="tiny | small | smollm2")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--concurrency", type=int, default=12, help="closed-loop clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-drift", type=float, default=0.10, help="'flat' for the verdict")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)

    model = model_dir(a.preset)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    ports = {"gateway": free_port(), "control-plane": free_port(), "worker": free_port()}
    redis_port = free_port()
    redis_args = ["--port", str(redis_port), "--save", "", "--appendonly", "no"]
    redis = Process("redis", redis_args, program=("redis-server",))
    up = Process(
        "up",
        [
            "up", "--model", str(model), "--dtype", a.dtype,
            "--port", str(ports["gateway"]), "--grpc-port", str(ports["control-plane"]),
            "--worker-base-port", str(ports["worker"]),
            "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
        ],
    )  # fmt: skip
    url = f"http://127.0.0.1:{ports['gateway']}"
    faults = Faults()
    rss: dict[str, list[float]] = {}
    report: dict[str, Any] = {"machine": machine(), "args": vars(a) | {"out": None}}
    try:
        up.wait_http(url + "/health", timeout=600)
        pids = child_pids(ports)

        def sample() -> None:
            for name in ("gateway", "control-plane"):
                rss.setdefault(name, []).append(rss_mib(pids.get(name, 0)))

        async def inject(start: float, seconds: float) -> None:
            nonlocal redis
            await asyncio.sleep(max(0.0, start + seconds / 3 - time.monotonic()))
            worker = child_pids({"worker": ports["worker"]}).get("worker")
            if worker is not None:
                os.kill(worker, signal.SIGKILL)
                faults.worker_killed = time.monotonic()
                await asyncio.sleep(0.5)  # the control plane notices within a probe
                if await until_healthy(url, 120):
                    faults.worker_back = time.monotonic()
            await asyncio.sleep(max(0.0, start + 2 * seconds / 3 - time.monotonic()))
            redis.proc.kill()
            redis.proc.wait()
            faults.redis_killed = time.monotonic()
            await asyncio.sleep(1.0)
            redis = Process("redis", redis_args, program=("redis-server",))
            faults.redis_back = time.monotonic()

        seconds = a.minutes * 60
        outcomes = asyncio.run(soak(url, seconds, a.concurrency, vocab, a.seed, inject, sample))

        drained = wait_drained(url)  # nothing running or waiting, no KV block used but cached
        replayed, *mismatches = asyncio.run(replay(url, outcomes, REPLAY_CONCURRENCY))
    finally:
        up.stop()
        redis.stop()

    by_kind: dict[str, Counter[str]] = {}
    for o in outcomes:
        key = "5xx" if o.server_error else str(o.status) if o.status else "transport"
        by_kind.setdefault(o.kind, Counter())[key] += 1
    errors_in = [o for o in outcomes if o.server_error and faults.in_failover(o)]
    errors_out = [o for o in outcomes if o.server_error and not faults.in_failover(o)]
    transport_out = [
        o
        for o in outcomes
        if not o.status
        and o.error
        and o.kind not in ("abort", "disconnect")
        and not faults.in_failover(o)
    ]
    unfinished_n2 = [
        o for o in outcomes if o.kind == "n2" and o.status == 200 and not o.error
        and sorted(o.finish) != [0, 1]
    ]  # fmt: skip
    memory = {name: rss_drift(values) for name, values in rss.items() if values}
    checks = {
        "no_lost_or_duplicated_tokens": not mismatches,
        "no_5xx_outside_failover": not errors_out and not transport_out,
        "worker_killed_and_back": faults.worker_back is not None,
        "redis_restarted": faults.redis_back is not None,
        "every_kind_ran": all(by_kind.get(k, Counter())["200"] > 0 for k in KINDS),
        "n2_choices_finish": not unfinished_n2,
        "logprobs_on_every_chunk": all(o.chunks_without_logprobs == 0 for o in outcomes),
        "drained": drained["running"] == 0 and drained["waiting"] == 0,
        "memory_flat": all(abs(v["drift"]) <= a.max_rss_drift for v in memory.values()),
    }
    report |= {
        "requests": len(outcomes),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "failover": {
            "worker_killed_s": faults.worker_killed,
            "window_s": (faults.worker_back - faults.worker_killed)
            if faults.worker_back and faults.worker_killed
            else None,
            "5xx_inside": len(errors_in),
        },
        "errors_outside_failover": sorted({o.error for o in errors_out + transport_out})[:5],
        "replayed": replayed["replayed"],
        "mismatches": mismatches[:10],
        "num_mismatches": len(mismatches),
        "drain": drained,
        "rss": memory,
        "checks": checks,
        "ok": all(checks.values()),
    }
    rows = [
        ["requests (by kind: status counts)", f"{len(outcomes)}: {json.dumps(report['by_kind'])}"],
        ["failover window (s), 5xx inside", f"{report['failover']['window_s']}, {len(errors_in)}"],
        ["5xx / transport errors outside it", f"{len(errors_out)} / {len(transport_out)}"],
        ["greedy replayed, mismatches", f"{replayed['replayed']}, {len(mismatches)}"],
        ["after the load: running / waiting / KV in use", json.dumps(drained)],
        *[
            [
                f"RSS {k} first / last / peak (MiB)",
                f"{v['first_mib']:.0f} / {v['last_mib']:.0f} / {v['peak_mib']:.0f} "
                f"({v['drift']:+.1%})",
            ]
            for k, v in memory.items()
        ],
        *[[f"check: {k}", "ok" if v else "FAILED"] for k, v in checks.items()],
    ]
    print(format_table(["", "figure"], rows))
    write_json(a.out or RESULTS_DIR / f"soak_{a.preset}.json", report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
