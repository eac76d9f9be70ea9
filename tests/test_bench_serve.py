"""`pagedserve bench serve`: the load generator's pieces against a scripted SSE server, and one
quick run against the real gateway stack."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pagedserve.cli.bench.cli import format_report
from pagedserve.cli.bench.client import request_body, send
from pagedserve.cli.bench.metrics import summarize
from pagedserve.cli.bench.serve import ServeConfig, arrival_times, run
from pagedserve.cli.bench.workload import (
    BenchRequest,
    LengthRange,
    chat_requests,
    random_requests,
    shared_prefix_requests,
)
from pagedserve.cli.main import main as cli_main
from pagedserve.latency import distribution
from pagedserve.ports import free_port
from tests.gateway_stack import GatewayStack, shared_gateway_stack


def _script(path: str, body: dict[str, Any]) -> tuple[int, list[str] | dict[str, Any]]:
    """A fake /v1/completions and /v1/chat/completions: one event per token (a chat stream
    opens with a role-only delta), then usage and [DONE]; or an error's status and body."""
    if path not in ("/v1/completions", "/v1/chat/completions"):
        return 404, {"error": {"message": f"no route {path}"}}
    if body["model"] != "fake" or not body["stream"]:
        return 400, {"error": {"message": "bad"}}
    n = body["max_tokens"]
    if path == "/v1/chat/completions":
        choices = [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
        choices += [{"index": 0, "delta": {"content": f"t{i}"}} for i in range(n)]
        prompt_tokens = 7
    else:
        choices = [{"index": 0, "text": f"t{i}"} for i in range(n)]
        prompt_tokens = len(body["prompt"])
    events = [json.dumps({"choices": [c]}) for c in choices]
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
    return 200, [*events, json.dumps({"choices": [], "usage": usage}), "[DONE]"]


class _Handler(BaseHTTPRequestHandler):
    """A real HTTP/1.1 server for the scripts above. The streams are chunked as servers do
    it, with the awkward cases a client must take: an event split over two chunks, two events
    in one chunk, and (on the chat path) CRLF line ends."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json(200, {"data": [{"id": "fake"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status, script = _script(self.path, body)
        if isinstance(script, dict):
            self._json(status, script)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        end = "\r\n" if self.path == "/v1/chat/completions" else "\n"
        events = [f"data: {e}{end}{end}".encode() for e in script]
        pieces = [events[0][:9], events[0][9:], *events[1:]]  # split mid-event
        if len(pieces) > 3:
            pieces[1:3] = [pieces[1] + pieces[2]]  # two events in one chunk
        for piece in pieces:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_workloads_are_seeded_and_shaped() -> None:
    a = random_requests(10, LengthRange(4, 8), LengthRange.parse("3"), 100, seed=1)
    assert a == random_requests(10, LengthRange(4, 8), LengthRange(3, 3), 100, seed=1)
    assert all(4 <= len(r.prompt) <= 8 and r.max_tokens == 3 for r in a)
    assert all(3 <= t < 100 for r in a for t in r.prompt)
    s = shared_prefix_requests(6, 2, 5, LengthRange(1, 2), LengthRange(2, 2), 100, seed=0)
    assert s[0].prompt[:5] == s[2].prompt[:5] != s[1].prompt[:5]
    with pytest.raises(ValueError):
        LengthRange.parse("9:3")


def test_arrival_schedules() -> None:
    assert arrival_times(3, math.inf, "poisson", 8, 0) == [0.0, 0.0, 0.0]
    assert arrival_times(5, 2.0, "burst", 2, 0) == [0.0, 0.0, 1.0, 1.0, 2.0]
    t = arrival_times(2000, 10.0, "poisson", 8, 0)
    assert t == sorted(t) and 180 < t[-1] < 220  # mean gap 1/rate
    with pytest.raises(ValueError):
        ServeConfig("http://x", request_rates=(0.0,))


def test_send_times_every_event_and_reads_usage(fake_url: str) -> None:
    async def go() -> None:
        res = await send(fake_url, BenchRequest([5, 6], 4), "fake")
        assert res.ok and res.output_tokens == 4 and len(res.chunk_times) == 4
        assert 0 <= res.ttft <= res.latency and len(res.itls) == 3
        assert res.tpot is not None and res.prompt_tokens == 2
        chat = await send(fake_url, chat_requests(1, 3)[0], "fake", False)
        # The role-only opening delta is not the first token.
        assert chat.ok and chat.output_tokens == 3 and len(chat.chunk_times) == 3
        assert chat.prompt_tokens == 7
        bad = await send(fake_url, BenchRequest([5], 2), "other")
        assert not bad.ok and bad.error is not None and "HTTP 400" in bad.error
        assert '"bad"' in bad.error
        # A base URL with a path: requests go under it.
        nested = await send(fake_url + "/prefix/", BenchRequest([5], 2), "fake")
        assert nested.error is not None and "HTTP 404" in nested.error
        assert "/prefix/v1/completions" in nested.error
        gone = await send(f"http://127.0.0.1:{free_port()}", BenchRequest([5], 2), "fake")
        assert not gone.ok and gone.error is not None and "ConnectionRefused" in gone.error

    asyncio.run(go())
    body = request_body(BenchRequest([1, 2], 3), "m", ignore_eos=True)
    assert body["stream"] and body["ignore_eos"] and body["stream_options"]["include_usage"]
    chat = request_body(chat_requests(2, 9, round_=1)[1], "m", ignore_eos=False)
    assert chat["messages"] == [{"role": "user", "content": "Please answer: What is 2 + 2?"}]
    assert "prompt" not in chat and chat["max_tokens"] == 9


def test_run_and_summaries(fake_url: str, tmp_path: Path) -> None:
    reqs = random_requests(6, LengthRange(2, 4), LengthRange(1, 5), 50, seed=0)
    cfg = ServeConfig(fake_url, request_rates=(50.0, math.inf), max_concurrency=2)
    report = asyncio.run(run(cfg, reqs))
    assert report["model"] == "fake" and len(report["runs"]) == 2
    for rate, r in zip(cfg.request_rates, report["runs"], strict=True):
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["output_tokens"] == sum(q.max_tokens for q in reqs)
        # Each request's send time, for a trace replay (pagedserve simulate --trace): never
        # before its place on the schedule (spread over the run at 50 requests/s, all at 0
        # when all are sent at once); a request waiting for a free slot is sent later.
        sent = [q["arrival_s"] for q in r["requests"]]
        schedule = arrival_times(6, rate, cfg.arrival, cfg.burst_size, cfg.seed)
        assert (max(schedule) > 0.02) == (rate == 50.0)
        assert all(s >= t - 0.005 for s, t in zip(sent, schedule, strict=True))
        assert r["output_throughput"] > 0 and r["ttft"]["p99_ms"] >= r["ttft"]["p50_ms"]
    report.update(num_prompts=6)
    assert "TTFT p99" in format_report(report)
    from pagedserve.cli.bench.plot import write_plot

    write_plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_reads_by_rate_and_in_ms(fake_url: str) -> None:
    """The rate panel: a linear axis whose last tick says "all at once", a legend naming both
    axes' series; TTFT and TPOT in ms; one run alone: three CDFs in a row, figures in the title."""
    from pagedserve.cli.bench.plot import build_figure

    reqs = random_requests(6, LengthRange(2, 4), LengthRange(2, 5), 50, seed=0)
    cfg = ServeConfig(fake_url, request_rates=(50.0, 100.0, math.inf), progress=False)
    report = asyncio.run(run(cfg, reqs))
    fig = build_figure(report)
    cdfs, rate = fig.axes[:3], fig.axes[3]
    assert [ax.get_xlabel() for ax in cdfs] == [
        "time to first token (ms)",
        "time per output token (ms)",
        "end-to-end latency (s)",
    ]
    tpots = [q["tpot_s"] for q in report["runs"][0]["requests"]]
    assert max(cdfs[1].lines[0].get_xdata()) == pytest.approx(max(tpots) * 1e3)
    assert [t.get_text() for t in cdfs[0].get_legend().get_texts()] == [
        "50 req/s",
        "100 req/s",
        "all at once",
    ]
    assert rate.get_xscale() == "linear"
    labels = [t.get_text() for t in rate.get_xticklabels()]
    assert labels[-1] == "all\nat once" and labels[:2] == ["0", "20"]  # plain linear ticks
    assert list(rate.lines[0].get_xdata()) == [50.0, 100.0]  # the finite rates where they are
    assert rate.get_xticks()[-1] > 100
    legend = rate.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [
        "output tok/s",
        "mean TTFT (ms)",
        "mean TPOT (ms)",
    ]
    assert fig.axes[4].get_ylabel() == "mean latency (ms)"  # the right-hand axis

    single = build_figure({**report, "runs": report["runs"][2:]})
    assert len(single.axes) == 3
    title = single.get_suptitle()
    assert "all at once:" in title and "output tok/s" in title and "TPOT" in title


def test_distribution_and_empty_summary() -> None:
    d = distribution([0.001, 0.002, 0.003])
    assert d["mean_ms"] == pytest.approx(2.0) and d["p50_ms"] == pytest.approx(2.0)
    assert summarize([], 1.0)["output_throughput"] == 0.0


def test_bench_serve_against_the_gateway(
    pytestconfig: pytest.Config, micro_llama: Path, tmp_path: Path
) -> None:
    gs: GatewayStack = shared_gateway_stack(pytestconfig, micro_llama)
    out = tmp_path / "serve.json"
    rc = cli_main(
        [
            "bench",
            "serve",
            "--base-url",
            gs.url,
            "--api-key",
            gs.api_key,
            "--num-prompts",
            "6",
            "--prompt-len",
            "4:16",
            "--output-len",
            "2:8",
            "--vocab-size",
            "512",
            "--request-rate",
            "20,inf",
            "--max-concurrency",
            "4",
            "--no-progress",
            "--out",
            str(out),
        ]  # fmt: skip
    )
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["ignore_eos"] is True
    for r in rep["runs"]:
        assert r["completed"] == 6
        assert [q["output_tokens"] for q in r["requests"]] == [
            q.max_tokens
            for q in random_requests(6, LengthRange(4, 16), LengthRange(2, 8), 512, seed=0)
        ]
        assert r["ttft"]["mean_ms"] > 0 and r["e2e"]["p99_ms"] >= r["ttft"]["p99_ms"]
