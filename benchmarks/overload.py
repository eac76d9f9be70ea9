"""Overload, slow readers and amplification against `pagedserve up`, with every process's memory.

Phases, one `up` for all of them:

1. **Unloaded**: streamed requests one at a time (mixed lengths): TTFT p50 / p99, at the
   client and inside the control plane (admission to the first token leaving the engine).
2. **Capacity**: `--clients` closed-loop clients for `--capacity-seconds` (each sends its next
   request when the last ends, or after a 429's Retry-After); completed requests per second.
3. **Overload**: Poisson arrivals at `--overload` × capacity for `--duration` seconds, mixed
   lengths; a share of the clients disconnect mid-stream, another share abort before their
   first token. Reported: status counts (200 / 429 / 5xx), the 429s' latency (at the client,
   and in the gateway from its access lines), the admitted requests' TTFT percentiles against
   the unloaded figure (and their share inside the engine), the RSS of every process (sampled
   each second; "flat" compares the last quarter with the first after warm-up), the cores each
   process kept busy, and how late the load client's own event loop woke (what of a latency
   it measures may be its own).
4. **Drain**: once the load stops, the waiting queue empties and no KV block stays in use.
5. **Slow readers**: streaming clients that never read, for longer than the gateway's
   `--stream-stall-timeout`: the gateway's and control plane's RSS before, at peak and after,
   how many were admitted (the status waiting on each socket, peeked at, never read) and
   whether those were aborted (KV blocks freed).
6. **Amplification**: one small request asking for prompts × n × max_tokens × logprobs far
   beyond the request budget: its status and size, and the memory it cost.

The server runs with `--max-queue-delay` (the benchmark's flag of that name; `off` drops it):
admission refuses what would wait longer than that for its first token behind the others. It
is the trade between the admitted requests' first-token latency and the capacity: the bound
that keeps the admitted TTFT p99 within 2x of the unloaded one on two cores is the default
per preset (`BOUNDS`: tiny 2 ms, whose lone prompt step takes a few milliseconds; SmolLM2
0.1 s), 20 ms for any other model.
`--server-args` passes more `up` flags. The load's requests each open a connection of their
own through a bare HTTP/1.1 client, since the load generator shares the server's cores.

    python -m benchmarks.overload --preset tiny
    python -m benchmarks.overload --preset smollm2
    python -m benchmarks.overload --preset tiny --max-queue-delay 0.02 --overload 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import socket
import statistics
import time
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
from pagedserve.cli.bench.client import post, sse_payloads
from pagedserve.heap import freeze_heap
from pagedserve.latency import percentile

STALL_TIMEOUT_S = 5.0
# --max-queue-delay by preset (seconds): what kept admitted TTFT p99 within 2x on two cores.
BOUNDS = {"tiny": "0.002", "smollm2": "0.1"}


@dataclass
class Outcome:
    status: int = 0
    kind: str = "normal"  # normal | disconnect | abort
    status_s: float = 0.0  # until the response's status line
    retry_after_s: float = 0.0
    ttft_s: float | None = None
    tokens: int = 0
    error: str = ""


@dataclass
class Sampler:
    """RSS of named processes, once a second, and the CPU seconds each (and the load client)
    used between the first sample and the last."""

    pids: dict[str, int]
    samples: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)

    def sample(self) -> None:
        for name, pid in self.pids.items():
            self.samples.setdefault(name, []).append(rss_mib(pid))
            self.cpu.setdefault(name, []).append(cpu_s(pid))
        t = os.times()
        self.cpu.setdefault("load client", []).append(t.user + t.system)
        self.times.append(time.monotonic())

    def cpu_shares(self) -> dict[str, float]:
        """Cores each process kept busy on average over the sampled span."""
        span = self.times[-1] - self.times[0] if self.times else 0.0
        if span <= 0:
            return {}
        return {k: (v[-1] - v[0]) / span for k, v in self.cpu.items()}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def child_pids(ports: dict[str, int]) -> dict[str, int]:
    """up's children, found by the ports on their command lines."""
    found: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
        except OSError:
            continue
        for name, port in ports.items():
            if "--port" in argv and argv[argv.index("--port") + 1] == str(port):
                if name in argv or (name == "redis" and "redis-server" in argv[0]):
                    found[name] = int(entry)
    return found


def body_for(rng: random.Random, vocab: int) -> dict[str, Any]:
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 192))]
    return {
        "prompt": prompt, "max_tokens": rng.randint(16, 128), "stream": True,
        "ignore_eos": True, "temperature": 0,
    }  # fmt: skip


# A streamed chunk that carries text (the completions API's "text" field, not empty).
_TEXT = re.compile(rb'"text": ?"(?!")')


async def one(url: str, body: dict[str, Any], kind: str) -> Outcome:
    """One streamed completion on a connection of its own, through the load generator's bare
    HTTP/1.1 client: the load shares the server's cores, so it must cost them as little as it
    can."""
    out = Outcome(kind=kind)
    start = time.monotonic()
    writer: asyncio.StreamWriter | None = None
    try:
        writer, resp = await post(url, "/v1/completions", body)
        out.status = resp.status
        out.status_s = time.monotonic() - start
        if out.status != 200:
            out.retry_after_s = float(resp.headers.get("retry-after", 0))
            text = b"".join([piece async for piece in resp.body()])
            out.error = text.decode(errors="replace")[:200]
            return out
        if kind == "abort":
            return out  # gone before the first token
        async for payload in sse_payloads(resp):
            if payload.startswith(b'{"error"'):
                out.error = payload[:200].decode(errors="replace")
                out.status = 500
                return out
            if _TEXT.search(payload):
                out.ttft_s = out.ttft_s or time.monotonic() - start
                out.tokens += 1
                if kind == "disconnect" and out.tokens >= 3:
                    return out  # gone mid-stream
    except (OSError, ValueError, IndexError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        if writer is not None:
            writer.close()
    return out


async def sequential(url: str, bodies: list[dict[str, Any]]) -> list[Outcome]:
    return [await one(url, b, "normal") for b in bodies]


async def closed_loop(
    url: str, clients: int, seconds: float, vocab: int, seed: int
) -> tuple[list[Outcome], float]:
    """`clients` clients, each sending its next request as soon as the last one ended (after
    a 429, once its Retry-After has passed), until `seconds` have passed; every outcome, and
    the wall time until the last request ended."""
    rng = random.Random(seed)
    outs: list[Outcome] = []
    start = time.monotonic()

    async def run() -> None:
        while time.monotonic() - start < seconds:
            out = await one(url, body_for(rng, vocab), "normal")
            outs.append(out)
            if out.status == 429:
                await asyncio.sleep(out.retry_after_s)

    await asyncio.gather(*(run() for _ in range(clients)))
    return outs, time.monotonic() - start


async def loop_lag(lags: list[float], period: float = 0.005) -> None:
    """How late the load client's own event loop wakes (appended to `lags`, seconds): a
    latency the client measures includes up to this much of its own."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(period)
        lags.append(max(0.0, time.monotonic() - t - period))


async def poisson(
    url: str,
    rate: float,
    duration: float,
    vocab: int,
    seed: int,
    sampler: Sampler,
    lags: list[float],
) -> list[Outcome]:
    rng = random.Random(seed)
    tasks: list[asyncio.Task[Outcome]] = []
    lag = asyncio.create_task(loop_lag(lags))
    start = time.monotonic()
    next_sample = start
    t = start
    while t - start < duration:
        t += rng.expovariate(rate)
        while time.monotonic() < t:
            if time.monotonic() >= next_sample:
                sampler.sample()
                next_sample += 1.0
            await asyncio.sleep(min(0.05, max(0.0, t - time.monotonic())))
        roll = rng.random()
        kind = "disconnect" if roll < 0.1 else "abort" if roll < 0.15 else "normal"
        tasks.append(asyncio.create_task(one(url, body_for(rng, vocab), kind)))
    outs = list(await asyncio.gather(*tasks))
    lag.cancel()
    return outs


def gateway_durations(log_text: str, status: int) -> list[float]:
    """The gateway's own time (s) for each completion that ended in `status`, from its access
    lines: from the request reaching the app to the response's end, without the connection's
    set-up or the client's side."""
    out = []
    for line in log_text.splitlines():
        if '"http_request"' not in line or f'"status": {status}' not in line:
            continue
        record = json.loads(line[line.index("{") :])
        if record.get("path") == "/v1/completions":
            out.append(float(record["duration_s"]))
    return out


def engine_ttfts(log_text: str) -> list[float]:
    """Each finished request's first-token time inside the control plane (admission to the
    token leaving the engine), from its `request_finished` lines: the admitted TTFT without
    the gateway, the sockets or the load client."""
    out = []
    for line in log_text.splitlines():
        if '"request_finished"' in line:
            ttft = json.loads(line[line.index("{") :]).get("time_to_first_token_s")
            if ttft is not None:
                out.append(float(ttft))
    return out


async def metrics(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(url + "/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pagedserve:") and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0].removeprefix("pagedserve:")
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def wait_drained(url: str, timeout: float = 120.0) -> dict[str, float | None]:
    """Waits (up to `timeout`) for nothing to run or wait; what /metrics says then."""
    start = time.monotonic()
    m: dict[str, float] = {}
    while time.monotonic() - start < timeout:
        m = asyncio.run(metrics(url))
        if m.get("num_requests_running", 1) == 0 and m.get("num_requests_waiting", 1) == 0:
            break
        time.sleep(0.5)
    return {
        "seconds": time.monotonic() - start,
        "running": m.get("num_requests_running"),
        "waiting": m.get("num_requests_waiting"),
        "kv_usage": m.get("gpu_cache_usage_perc"),
    }


def rss_drift(values: list[float]) -> dict[str, float]:
    """Once-a-second RSS samples: the first and last quarter's means after a sixth of warm-up,
    the peak, and the relative change ("flat" when small)."""
    warm = values[len(values) // 6 :] or values
    quarter = max(1, len(warm) // 4)
    first, last = statistics.mean(warm[:quarter]), statistics.mean(warm[-quarter:])
    return {
        "first_mib": first,
        "last_mib": last,
        "peak_mib": max(values),
        "drift": (last - first) / first if first else 0.0,
    }


def never_reading(port: int, body: dict[str, Any]) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    s.sendall((head + f"Content-Length: {len(data)}\r\n\r\n").encode() + data)
    return s


def peeked_status(s: socket.socket) -> int:
    """The status of the response waiting on a never-read socket, looked at without taking it
    off the socket (0: none yet)."""
    try:
        head = s.recv(12, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0
    return int(head[9:12]) if head.startswith(b"HTTP/1.1 ") else 0


def pct(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="tiny", help="tiny | small | smollm2")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of overload")
    p.add_argument("--overload", type=float, default=4.0, help="offered load / capacity")
    p.add_argument("--clients", type=int, default=64, help="closed-loop clients for capacity")
    p.add_argument("--capacity-seconds", type=float, default=20.0)
    p.add_argument(
        "--unloaded",
        type=int,
        default=200,
        help="sequential requests, unloaded (a p99 of fewer is hardly more than their maximum)",
    )
    p.add_argument(
        "--max-queue-delay",
        default=None,
        help="the server's --max-queue-delay (s, or off); default by preset (BOUNDS), else 0.02",
    )
    p.add_argument("--slow-readers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--server-args", default="", help="more `pagedserve up` flags, e.g. '--num-threads 1'"
    )
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.max_queue_delay is None:
        a.max_queue_delay = BOUNDS.get(a.preset, "0.02")

    model = model_dir(a.preset)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    ports = {"gateway": free_port(), "control-plane": free_port(), "worker": free_port()}
    up = Process(
        "up",
        [
            "up", "--model", str(model), "--port", str(ports["gateway"]),
            "--grpc-port", str(ports["control-plane"]),
            "--worker-base-port", str(ports["worker"]),
            "--stream-stall-timeout", str(STALL_TIMEOUT_S),
            *(["--max-queue-delay", a.max_queue_delay] if a.max_queue_delay != "off" else []),
            *shlex.split(a.server_args),
        ],
    )  # fmt: skip
    url = f"http://127.0.0.1:{ports['gateway']}"
    report: dict[str, Any] = {
        "machine": machine(),
        "preset": a.preset,
        "args": vars(a) | {"out": None},
    }
    try:
        up.wait_http(url + "/health", timeout=600)
        pids = child_pids(ports)
        freeze_heap()  # the load client's own collections must not stretch what it measures
        rng = random.Random(a.seed)
        asyncio.run(sequential(url, [body_for(rng, vocab) for _ in range(3)]))  # warm-up

        # 1. unloaded
        log_start = len(up.output())
        unloaded = asyncio.run(sequential(url, [body_for(rng, vocab) for _ in range(a.unloaded)]))
        ttft0 = [o.ttft_s for o in unloaded if o.ttft_s is not None]
        engine0 = engine_ttfts(up.output()[log_start:])
        report["unloaded"] = {"ttft_p50_s": pct(ttft0, 50), "ttft_p99_s": pct(ttft0, 99),
                              "engine_ttft_p50_s": pct(engine0, 50),
                              "engine_ttft_p99_s": pct(engine0, 99)}  # fmt: skip

        # 2. capacity
        outs, wall = asyncio.run(closed_loop(url, a.clients, a.capacity_seconds, vocab, a.seed + 2))
        done = sum(o.status == 200 for o in outs)
        capacity = done / wall
        report["capacity"] = {"clients": a.clients, "completed": done, "wall_s": wall,
                              "rejected": sum(o.status == 429 for o in outs),
                              "requests_per_s": capacity}  # fmt: skip

        # 3. overload
        sampler = Sampler(pids | {"up": up.proc.pid})
        rate = a.overload * capacity
        lags: list[float] = []
        log_start = len(up.output())
        outs = asyncio.run(poisson(url, rate, a.duration, vocab, a.seed + 1, sampler, lags))
        served = gateway_durations(up.output()[log_start:], 429)
        engine = engine_ttfts(up.output()[log_start:])
        by_status: dict[str, int] = {}
        for o in outs:
            key = "5xx" if o.status >= 500 else str(o.status) if o.status else "transport"
            by_status[key] = by_status.get(key, 0) + 1
        admitted = [o.ttft_s for o in outs if o.status == 200 and o.ttft_s is not None]
        rejected = [o.status_s for o in outs if o.status == 429]
        rss = {name: rss_drift(values) for name, values in sampler.samples.items()}
        p99 = pct(admitted, 99)
        p99_0 = report["unloaded"]["ttft_p99_s"]
        errors = {o.error for o in outs if o.status >= 500 or (o.error and not o.status)}
        report["overload"] = {
            "offered_rate": rate,
            "duration_s": a.duration,
            "requests": len(outs),
            "status": by_status,
            "admitted_ttft_p50_s": pct(admitted, 50),
            "admitted_ttft_p99_s": p99,
            "ttft_p99_vs_unloaded": p99 / p99_0 if p99 and p99_0 else None,
            "engine_ttft_p50_s": pct(engine, 50),
            "engine_ttft_p99_s": pct(engine, 99),
            "rejected_latency_p50_ms": (pct(rejected, 50) or 0) * 1000,
            "rejected_latency_p99_ms": (pct(rejected, 99) or 0) * 1000,
            "rejected_in_gateway_p50_ms": (pct(served, 50) or 0) * 1000,
            "rejected_in_gateway_p99_ms": (pct(served, 99) or 0) * 1000,
            "client_loop_lag_p50_ms": (pct(lags, 50) or 0) * 1000,
            "client_loop_lag_p99_ms": (pct(lags, 99) or 0) * 1000,
            "errors": sorted(errors)[:5],
            "rss": rss,
            "cpu_cores": sampler.cpu_shares(),
        }

        # 4. drain
        report["drain"] = wait_drained(url)

        # 5. slow readers
        gw, cp = pids.get("gateway", 0), pids.get("control-plane", 0)
        before = {"gateway": rss_mib(gw), "control-plane": rss_mib(cp)}
        aborted0 = asyncio.run(metrics(url)).get("num_requests_aborted_total", 0.0)
        slow = {"prompt": [5, 6, 7], "max_tokens": 2000, "n": 8, "logprobs": 5,
                "stream": True, "ignore_eos": True, "temperature": 1.0}  # fmt: skip
        sockets = [never_reading(ports["gateway"], slow) for _ in range(a.slow_readers)]
        peak = dict(before)
        start = time.monotonic()
        while time.monotonic() - start < STALL_TIMEOUT_S + 30:
            peak = {
                k: max(peak[k], rss_mib(pid)) for k, pid in (("gateway", gw), ("control-plane", cp))
            }
            m = asyncio.run(metrics(url))
            if m.get("num_requests_running", 1) == 0 and time.monotonic() - start > 1:
                break
            time.sleep(0.5)
        statuses = [peeked_status(s) for s in sockets]
        for s in sockets:
            s.close()
        time.sleep(2)
        after = {"gateway": rss_mib(gw), "control-plane": rss_mib(cp)}
        aborted = asyncio.run(metrics(url)).get("num_requests_aborted_total", 0.0) - aborted0
        report["slow_readers"] = {"clients": a.slow_readers, "request": slow,
                                  "rss_before_mib": before, "rss_peak_mib": peak,
                                  "rss_after_mib": after, "aborted": aborted,
                                  "admitted": statuses.count(200),
                                  "status": {str(c): statuses.count(c) for c in set(statuses)},
                                  "seconds_to_abort": time.monotonic() - start - 2}  # fmt: skip

        # 6. amplification
        big = {"prompt": ["Hello"] * 16, "n": 16, "logprobs": 20, "max_tokens": 1000,
               "ignore_eos": True}  # fmt: skip
        before = {"gateway": rss_mib(gw), "control-plane": rss_mib(cp)}
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=big, timeout=600)
        report["amplification"] = {
            "request_bytes": len(json.dumps(big)), "status": r.status_code,
            "response_bytes": len(r.content), "seconds": time.monotonic() - start,
            "message": r.json().get("error", {}).get("message") if r.status_code != 200 else None,
            "rss_before_mib": before,
            "rss_after_mib": {"gateway": rss_mib(gw), "control-plane": rss_mib(cp)},
        }  # fmt: skip
    finally:
        up.stop()

    o, u, sr = report["overload"], report["unloaded"], report["slow_readers"]

    def ms(*values: float | None) -> str:
        return " / ".join(f"{(v or 0) * 1e3:.0f}" for v in values)

    def mib(key: str) -> str:
        return " / ".join(
            f"{sr[k][key]:.0f}" for k in ("rss_before_mib", "rss_peak_mib", "rss_after_mib")
        )

    drain = report["drain"]
    amp = report["amplification"]
    rows = [
        ["unloaded TTFT p50 / p99 (ms)", ms(u["ttft_p50_s"], u["ttft_p99_s"])],
        [
            "of which in the engine, p50 / p99 (ms)",
            ms(u["engine_ttft_p50_s"], u["engine_ttft_p99_s"]),
        ],
        ["capacity (requests/s)", f"{report['capacity']['requests_per_s']:.2f}"],
        ["offered (requests/s)", f"{o['offered_rate']:.2f}"],
        ["status counts", json.dumps(o["status"])],
        ["admitted TTFT p50 / p99 (ms)", ms(o["admitted_ttft_p50_s"], o["admitted_ttft_p99_s"])],
        ["admitted TTFT p99 / unloaded p99", f"{o['ttft_p99_vs_unloaded'] or 0:.2f}x"],
        [
            "of which in the engine, p50 / p99 (ms)",
            ms(o["engine_ttft_p50_s"], o["engine_ttft_p99_s"]),
        ],
        [
            "429 latency p50 / p99 (ms)",
            f"{o['rejected_latency_p50_ms']:.1f} / {o['rejected_latency_p99_ms']:.1f}",
        ],
        [
            "429 in the gateway p50 / p99 (ms)",
            f"{o['rejected_in_gateway_p50_ms']:.1f} / {o['rejected_in_gateway_p99_ms']:.1f}",
        ],
        [
            "load client's loop lag p50 / p99 (ms)",
            f"{o['client_loop_lag_p50_ms']:.1f} / {o['client_loop_lag_p99_ms']:.1f}",
        ],
        *[
            [
                f"RSS {k} first / last / peak (MiB)",
                f"{v['first_mib']:.0f} / {v['last_mib']:.0f} / {v['peak_mib']:.0f} "
                f"({v['drift']:+.1%})",
            ]
            for k, v in o["rss"].items()
        ],
        [
            "cores busy during the overload",
            ", ".join(f"{k} {v:.2f}" for k, v in o["cpu_cores"].items()),
        ],
        [
            "after the load: running / waiting / KV in use",
            f"{drain['running']} / {drain['waiting']} / {drain['kv_usage']}",
        ],
        ["slow readers: gateway RSS before / peak / after (MiB)", mib("gateway")],
        ["slow readers: control plane RSS before / peak / after (MiB)", mib("control-plane")],
        [
            "slow readers: admitted (statuses), aborted",
            f"{sr['admitted']} of {a.slow_readers} ({json.dumps(sr['status'])}), "
            f"{sr['aborted']:.0f}",
        ],
        ["amplification: status, response bytes", f"{amp['status']}, {amp['response_bytes']}"],
    ]
    print(format_table(["", "figure"], rows))
    write_json(a.out or RESULTS_DIR / f"overload_{a.preset}.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
